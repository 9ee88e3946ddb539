"""Builds the optional compiled trie kernel; everything else is in pyproject.toml.

``optional=True``: where no C compiler is found, or the build fails, setuptools prints a
warning and installs the package without it; ``ParallelTokenCharacterTrie`` then uses its
torch path on the CPU (``genlm_backend/trie/_compiled.py``). An editable install builds it in
place (``*.so`` beside its source, git-ignored): after editing the ``.c`` file, rerun
``pip install --no-deps -e .``. ``scripts/check_c.sh`` runs its tests under AddressSanitizer.
"""

import sys

from setuptools import Extension, setup

compile_args = [] if sys.platform == "win32" else ["-O3"]
link_args = [] if sys.platform == "win32" else ["-pthread"]

setup(
    ext_modules=[
        Extension(
            "genlm_backend.trie._kernel",
            sources=["genlm_backend/trie/_kernel.c"],
            extra_compile_args=compile_args,
            extra_link_args=link_args,
            optional=True,
        ),
    ]
)

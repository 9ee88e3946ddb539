"""Builds the optional compiled kernels; everything else is in pyproject.toml.

``optional=True``: where no C compiler is found, or a build fails, setuptools prints a
warning and installs the package without it. Without the trie kernel
``ParallelTokenCharacterTrie`` uses its torch path on the CPU (``genlm_backend/trie/_compiled.py``);
without the prompt kernel the prompt checker uses Python (``genlm_backend/llm/prompts.py``).
An editable install builds them in place (``*.so`` beside their sources, git-ignored): after
editing a ``.c`` file, rerun ``pip install --no-deps -e .``.
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
        Extension(
            "genlm_backend.llm._prompt_kernel",
            sources=["genlm_backend/llm/_prompt_kernel.c"],
            extra_compile_args=compile_args,
            optional=True,
        ),
    ]
)

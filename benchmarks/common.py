"""Shared measuring helpers of the benchmark scripts: repeat, summarise, write JSON, and run
one configuration in a child process of its own.

Every workload warms up once, repeats, and reports the median with min and max. Ratios are
taken against a floor measured in the same run; absolute times are never compared across
runs or machines.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# The figures of record, which the READMEs cite: written only where a run is told to
# (``--out-dir benchmarks/results``).
RESULTS_DIR = Path(__file__).parent / "results"
# Where a run writes unless told otherwise (git-ignored).
SCRATCH_DIR = Path(__file__).resolve().parent.parent / "benchmark-out"


def measure(fn: Callable[[], Any], *, repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Calls ``fn`` ``warmup`` times unmeasured, then ``repeats`` times; returns seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return summarise(times)


def summarise(times: list[float]) -> dict[str, float]:
    return {
        "median_s": statistics.median(times),
        "min_s": min(times),
        "max_s": max(times),
        "repeats": len(times),
    }


def machine_info() -> dict[str, Any]:
    """The hardware and versions a result was measured on."""
    import torch

    info: dict[str, Any] = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "omp_num_threads": os.environ.get("OMP_NUM_THREADS"),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    for name in ("transformers", "vllm"):
        try:
            module = __import__(name)
            info[name] = getattr(module, "__version__", "?")
        except Exception:  # noqa: BLE001 - absent or broken: recorded as missing
            info[name] = None
    return info


def write_json(name: str, payload: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Writes ``payload`` plus machine info to ``out_dir/name.json`` (default:
    :data:`SCRATCH_DIR`) and returns the path."""
    out_dir = Path(out_dir or SCRATCH_DIR)
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    payload = {"workload": name, "machine": machine_info(), **payload}
    path.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    return path


# The line a child process prints its result on (see run_child and report).
RESULT_MARK = "@result "


def run_child(script: str, setup: dict[str, Any], env: dict[str, str], what: str) -> dict[str, Any]:
    """Runs ``python script --serve SETUP`` (``setup`` as JSON) with ``env`` and returns the
    result it printed with :func:`report`.

    Raises:
        RuntimeError: the child printed no result (``what`` names it), with its stderr's tail.
    """
    child = subprocess.run(
        [sys.executable, script, "--serve", json.dumps(setup)],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )
    for line in child.stdout.splitlines():
        if line.startswith(RESULT_MARK):
            return json.loads(line.removeprefix(RESULT_MARK))
    raise RuntimeError(f"{what} failed (exit {child.returncode}):\n{child.stderr[-6000:]}")


def report(result: dict[str, Any], **dumps: Any) -> None:
    """In a child process of :func:`run_child`: prints ``result`` for its parent."""
    print(RESULT_MARK + json.dumps(result, **dumps), flush=True)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    """Prints ``rows`` as an aligned text table with the given columns."""
    cells = [[_fmt(row.get(c)) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    print("  ".join("-" * w for w in widths))
    for r in cells:
        print("  ".join(v.ljust(w) for v, w in zip(r, widths)))


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)

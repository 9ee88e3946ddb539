"""The walk of one ``next_token_logprobs`` request through the package, on the vLLM backend.

Starts an ``AsyncVirtualLM`` on the tiny fp32 Llama of the vLLM tests
(``tests/llm/vllm_fixtures.py``), warms it up, then records with ``sys.setprofile`` (on the
event loop's thread and on the engine thread) every call into a file of the package while one
request is awaited: a fresh prompt, then the same prompt one token longer (the lockstep case:
it continues the first one's engine session). Prints, for each:

- files: the distinct files of the package entered;
- entries: calls that cross from one file into another file of the package;
- hops: how often the walk moves from one thread to the other (event order).

Works on any checkout of the package (put it first on ``PYTHONPATH``): run it on two to
compare them. ``python benchmarks/diagnostics/request_walk.py [--list]``
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import threading
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
REPO = Path(__file__).resolve().parents[2]


class Recorder:
    """Calls into the package's files, as (thread, file, caller's file), while on."""

    def __init__(self, package: Path):
        self.root = str(package) + os.sep
        self.on = False
        self.calls: list[tuple[int, str, str | None]] = []

    def profile(self, frame, event, arg):  # sys.setprofile's signature
        if event != "call" or not self.on:
            return
        name = frame.f_code.co_filename
        if not name.startswith(self.root):
            return
        back = frame.f_back
        caller = back.f_code.co_filename if back is not None else None
        self.calls.append((threading.get_ident(), name[len(self.root):], caller))

    def summary(self) -> dict:
        files = sorted({f for _, f, _ in self.calls})
        entries = sum(1 for _, f, caller in self.calls
                      if caller is None or not caller.endswith(os.sep + f))
        hops = sum(1 for a, b in zip(self.calls, self.calls[1:]) if a[0] != b[0])
        threads = len({t for t, _, _ in self.calls})
        return {"files": len(files), "entries": entries, "hops": hops, "threads": threads,
                "calls": len(self.calls), "file_list": files}


def engine_thread_of(lm):
    """The model's engine thread, wherever this checkout keeps it."""
    engine = getattr(lm, "engine", None)
    return engine.thread if engine is not None else lm._engine_thread


async def walk(lm, recorder: Recorder, prompt: list[int]) -> dict:
    recorder.calls.clear()
    recorder.on = True
    try:
        row = await lm.next_token_logprobs(prompt)
    finally:
        recorder.on = False
    return {**recorder.summary(), "next": int(row.argmax())}


async def measure(lm, recorder: Recorder) -> list[tuple[str, dict]]:
    for i in range(3):  # warm: the first steps compile and allocate
        rows = await asyncio.gather(*(lm.next_token_logprobs([1, 50 + i, 60 + j])
                                      for j in range(4)))
        assert len(rows) == 4
    prompt = [1, 300, 301, 302, 303]
    fresh = await walk(lm, recorder, prompt)
    continued = await walk(lm, recorder, prompt + [fresh["next"]])
    return [("fresh prompt", fresh), ("continued (+1 token)", continued)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--list", action="store_true", help="print the files entered")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO / "tests" / "llm"))
    from vllm_fixtures import ENGINE_OPTS, build_tiny_llama

    import genlm_backend
    from genlm_backend.llm.vllm import AsyncVirtualLM

    package = Path(genlm_backend.__file__).resolve().parent
    recorder = Recorder(package)
    with tempfile.TemporaryDirectory() as tmp:
        folder = build_tiny_llama(Path(tmp) / "base")
        lm = AsyncVirtualLM.from_name(str(folder), engine_opts=dict(ENGINE_OPTS))
        try:
            engine_thread_of(lm).submit(sys.setprofile, recorder.profile).result()
            sys.setprofile(recorder.profile)
            try:
                results = asyncio.run(measure(lm, recorder))
            finally:
                sys.setprofile(None)
        finally:
            lm.cleanup()
    print(f"package: {package}")
    for name, result in results:
        print(f"{name:>22}: {result['files']} files, {result['entries']} entries into a file, "
              f"{result['hops']} thread hops ({result['threads']} threads, "
              f"{result['calls']} calls)")
        if args.list:
            print("    " + ", ".join(result["file_list"]))


if __name__ == "__main__":
    main()

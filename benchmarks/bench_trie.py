"""W3: token-character tries on the 32k SentencePiece and the 131k tekken vocabularies.

Measures, per vocabulary: trie construction (sequential and parallel), sequential
``weight_sum`` / ``weight_max`` (float32 torch input, as constrained samplers pass it),
parallel CPU ``batch_weight_sum`` with B=1 and B=64 and ``batch_weight_max`` with B=64
(on the compiled kernel where it was built, and again on the torch/numpy fallback, rows
``parallel cpu fallback ...``, in the same run), 64 concurrent awaits of the async trie,
and, when ``torch.cuda.is_available()``, the GPU ``batch_weight_sum`` / ``batch_weight_max``
with B=1 and B=64 for both parallel strategies.
Every workload is seeded, warmed up once and repeated; the table gives the median with min
and max, the target where the issue sets one, and the ratio against a floor measured in the
same run: allocating and writing an output of the same shape (``[B, num_nodes]`` float32; on
the CPU with numpy, in a huge-page-advised buffer like the tries' own), the least any
implementation must do. Load on a shared machine shows up in the floor too. GPU timings
synchronize before the clock stops.

Targets (2-core CPU; GPU: H100): construction < 1 s for 131k; sequential ``weight_sum``
<= 2 ms for 131k; parallel CPU B=64 <= 30 ms for 131k; GPU B=64, V=131k <= 1 ms.

Vocabularies, in order of preference:
    1. ``--vocab-dir DIR``: ``DIR/sentencepiece.pkl`` and ``DIR/tekken.pkl`` (pickled
       ``list[bytes]``, written by ``--save-vocab``), else the raw files
       ``DIR/tokenizer.model.v1`` (read with the ``sentencepiece`` package) and
       ``DIR/tekken_240718.json`` (read with ``json`` + ``base64`` only);
    2. ``decode_vocab`` of the tokenizers in ``tests/real_tokenizers.py`` (needs transformers and
       mistral_common), timed as its own row;
    3. the raw files in the installed ``mistral_common`` package's data folder.

A machine without mistral_common (the GPU machine) needs only torch and numpy. Prepare the
vocabularies here, in the repository root, and carry the folder along::

    echo /.benchvocab/ >> .git/info/exclude
    python benchmarks/bench_trie.py --save-vocab .benchvocab     # writes the two pickles
    # on the GPU machine, with .benchvocab carried:
    python benchmarks/bench_trie.py --vocab-dir .benchvocab --out $OUT

Run::

    python benchmarks/bench_trie.py [--quick] [--out DIR] [--vocab-dir DIR] [--save-vocab DIR]
                                    [--family sentencepiece|tekken] [--threads N] [--no-kernel]

The compiled kernel shares rows out between ``torch.get_num_threads()`` threads: set
``OMP_NUM_THREADS`` (or ``--threads``) to say how many.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import pickle
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import measure, print_table, write_json
from genlm_backend.trie import (
    AsyncTokenCharacterTrie,
    ParallelTokenCharacterTrie,
    TokenCharacterTrie,
    _compiled,
)
from genlm_backend.trie._memory import empty_cpu

FAMILIES = {"sentencepiece": "tokenizer.model.v1", "tekken": "tekken_240718.json"}
TARGETS_MS = {
    ("tekken", "construct TokenCharacterTrie"): 1000.0,
    ("tekken", "sequential weight_sum"): 2.0,
    ("tekken", "parallel cpu batch_weight_sum B=64"): 30.0,
    ("tekken", "gpu flat batch_weight_sum B=64"): 1.0,
}


# ---- vocabularies ---------------------------------------------------------------------


def read_sentencepiece(path: Path) -> list[bytes]:
    import sentencepiece

    model = sentencepiece.SentencePieceProcessor(model_file=str(path))
    vocab = []
    for i in range(model.get_piece_size()):
        piece = model.id_to_piece(i)
        if model.is_byte(i):
            vocab.append(bytes([int(piece[3:5], 16)]))
        else:
            vocab.append(piece.replace("\u2581", " ").encode())
    return vocab


def read_tekken(path: Path) -> list[bytes]:
    data = json.loads(path.read_text())
    num_special = data["config"]["default_num_special_tokens"]
    size = data["config"]["default_vocab_size"]
    vocab = [b"<SPECIAL_%d>" % i for i in range(num_special)]
    vocab += [base64.b64decode(e["token_bytes"]) for e in data["vocab"][: size - num_special]]
    return vocab


def read_raw(family: str, folder: Path) -> list[bytes]:
    path = folder / FAMILIES[family]
    return read_sentencepiece(path) if family == "sentencepiece" else read_tekken(path)


def load_vocab(family: str, vocab_dir: Path | None, rows: list, repeats: int) -> tuple[list, str]:
    if vocab_dir is not None:
        pickled = vocab_dir / f"{family}.pkl"
        if pickled.is_file():
            return pickle.loads(pickled.read_bytes()), f"pickle {pickled}"
        return read_raw(family, vocab_dir), f"raw file in {vocab_dir}"
    try:
        from genlm_backend.tokenization import decode_vocab
        from tests.real_tokenizers import load_tokenizer

        tokenizer = load_tokenizer(family)
    except Exception as exc:  # noqa: BLE001 - fall back to the raw files
        import mistral_common

        print(f"[{family}] decode_vocab unavailable ({exc!r}); reading the raw file")
        return read_raw(family, Path(mistral_common.__file__).parent / "data"), "raw file"
    stats = measure(lambda: decode_vocab(tokenizer), repeats=repeats)
    rows.append(row(family, "decode_vocab", stats))
    return decode_vocab(tokenizer)[0], "decode_vocab"


# ---- measuring --------------------------------------------------------------------------


def row(family: str, workload: str, stats: dict, floor: dict | None = None) -> dict:
    out = {
        "vocab": family,
        "workload": workload,
        "median_ms": stats["median_s"] * 1e3,
        "min_ms": stats["min_s"] * 1e3,
        "max_ms": stats["max_s"] * 1e3,
        "repeats": stats["repeats"],
    }
    target = TARGETS_MS.get((family, workload))
    if target is not None:
        out["target_ms"] = target
        out["meets_target"] = out["median_ms"] <= target
    if floor is not None:
        out["floor_ms"] = floor["median_s"] * 1e3
        out["x_floor"] = stats["median_s"] / floor["median_s"]
    return out


def output_floor(batch: int, num_nodes: int, device: str) -> dict:
    """Allocating and writing a float32 ``[batch, num_nodes]`` output: on the CPU with numpy
    (one thread) in a buffer advised to use huge pages, as the tries allocate theirs."""
    if device == "cpu":
        return measure(
            lambda: empty_cpu((batch, num_nodes), np.float32, like="numpy").fill(1.0), repeats=20
        )
    return timed(lambda: torch.empty(batch, num_nodes, device=device).fill_(1.0), device, 20)


def timed(fn, device: str, repeats: int) -> dict:
    if device.startswith("cuda"):

        def run():
            fn()
            torch.cuda.synchronize(device)

        return measure(run, repeats=repeats)
    return measure(fn, repeats=repeats)


def bench_vocab(family: str, vocab: list, rows: list, quick: bool) -> None:
    reps = 3 if quick else 20
    rng = np.random.default_rng(0)
    size = len(vocab)
    batch = torch.from_numpy(rng.dirichlet(np.ones(size), size=64).astype(np.float32))
    one = batch[:1]

    stats = measure(lambda: TokenCharacterTrie(vocab), repeats=1 if quick else 3)
    rows.append(row(family, "construct TokenCharacterTrie", stats))
    stats = measure(
        lambda: ParallelTokenCharacterTrie(vocab, device="cpu"), repeats=1 if quick else 3
    )
    rows.append(row(family, "construct ParallelTokenCharacterTrie cpu", stats))

    trie = TokenCharacterTrie(vocab)
    n = trie.num_nodes
    floor1, floor64 = output_floor(1, n, "cpu"), output_floor(64, n, "cpu")
    rows.append(row(family, "floor: write [1, N] float32", floor1))
    rows.append(row(family, "floor: write [64, N] float32", floor64))
    rows.append(
        row(
            family,
            "sequential weight_sum",
            measure(lambda: trie.weight_sum(one[0]), repeats=reps),
            floor1,
        )
    )
    rows.append(
        row(
            family,
            "sequential weight_sum numpy64",
            measure(lambda: trie.weight_sum(one[0].double().numpy()), repeats=reps),
            floor1,
        )
    )
    logs = batch.log()
    rows.append(
        row(
            family,
            "sequential weight_max",
            measure(lambda: trie.weight_max(logs[0]), repeats=reps),
            floor1,
        )
    )

    parallel = ParallelTokenCharacterTrie(vocab, device="cpu")
    tries = [("parallel cpu", parallel)]
    if _compiled.KERNEL is not None:  # the same workloads without the kernel, for the ratio
        tries.append(("parallel cpu fallback", fallback_trie(vocab)))
    for name, trie_ in tries:
        for b, floor in ((1, floor1), (64, floor64)):
            ws = batch[:b]
            stats = measure(lambda t=trie_, ws=ws: t.batch_weight_sum(ws), repeats=reps)
            rows.append(row(family, f"{name} batch_weight_sum B={b}", stats, floor))
        stats = measure(lambda t=trie_: t.batch_weight_max(logs), repeats=reps)
        rows.append(row(family, f"{name} batch_weight_max B=64", stats, floor64))
    rows.append(
        row(
            family,
            "async 64 awaits weight_sum (parallel cpu)",
            bench_async(parallel, batch, reps),
            floor64,
        )
    )

    if torch.cuda.is_available():
        bench_gpu(family, vocab, batch, rows, reps)


def fallback_trie(vocab: list) -> ParallelTokenCharacterTrie:
    """A CPU trie built as if the compiled kernel were missing (its torch/numpy path)."""
    kernel, _compiled.KERNEL = _compiled.KERNEL, None
    try:
        return ParallelTokenCharacterTrie(vocab, device="cpu")
    finally:
        _compiled.KERNEL = kernel


def bench_async(trie, batch, reps: int) -> dict:
    executor = AsyncTokenCharacterTrie(trie)
    rows = list(batch)

    async def once():
        await asyncio.gather(*[executor.weight_sum(r) for r in rows])

    async def run():
        for _ in range(1):
            await once()
        times = []
        for _ in range(reps):
            start = time.perf_counter()
            await once()
            times.append(time.perf_counter() - start)
        return times

    from benchmarks.common import summarise

    times = asyncio.run(run())
    executor.shutdown()
    return summarise(times)


def bench_gpu(family: str, vocab: list, batch: torch.Tensor, rows: list, reps: int) -> None:
    device = "cuda"
    ws = batch.to(device)
    logs = ws.log()
    for strategy in ("flat", "levels"):
        start = time.perf_counter()
        trie = ParallelTokenCharacterTrie(vocab, device=device, strategy=strategy)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - start  # once: the first build includes CUDA set-up
        rows.append(
            row(
                family,
                f"construct gpu {strategy} (once)",
                {"median_s": seconds, "min_s": seconds, "max_s": seconds, "repeats": 1},
            )
        )
        n = trie.num_nodes
        for b in (1, 64):
            floor = output_floor(b, n, device)
            stats = timed(lambda t=trie, b=b: t.batch_weight_sum(ws[:b]), device, reps * 5)
            rows.append(row(family, f"gpu {strategy} batch_weight_sum B={b}", stats, floor))
        stats = timed(lambda t=trie: t.batch_weight_max(logs), device, reps * 5)
        rows.append(row(family, f"gpu {strategy} batch_weight_max B=64", stats, floor))
        want = TokenCharacterTrie(vocab).batch_weight_sum(batch[:4].double())
        got = trie.batch_weight_sum(ws[:4]).double().cpu()
        error = float((got - want).abs().max())
        print(f"[{family}] gpu {strategy}: max |sum - sequential| over 4 rows = {error:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="fewer repeats")
    parser.add_argument("--out", type=Path, default=None, help="folder of the JSON result")
    parser.add_argument("--vocab-dir", type=Path, default=None, help="pickled or raw vocabularies")
    parser.add_argument(
        "--save-vocab",
        type=Path,
        default=None,
        help="write DIR/<family>.pkl (list[bytes]) for --vocab-dir and exit",
    )
    parser.add_argument("--family", choices=list(FAMILIES), action="append", default=None)
    parser.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch.set_num_threads for the CPU workloads (default: torch's)",
    )
    parser.add_argument(
        "--no-kernel",
        action="store_true",
        help="run the CPU tries on their torch/numpy path even where the kernel was built",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.no_kernel:
        _compiled.KERNEL = None
    torch.manual_seed(0)
    rows: list = []
    sources = {}
    for family in args.family or list(FAMILIES):
        vocab, sources[family] = load_vocab(family, args.vocab_dir, rows, 1 if args.quick else 3)
        if args.save_vocab is not None:
            args.save_vocab.mkdir(parents=True, exist_ok=True)
            path = args.save_vocab / f"{family}.pkl"
            path.write_bytes(pickle.dumps([bytes(t) for t in vocab]))
            print(f"wrote {path} ({len(vocab)} tokens)")
            continue
        print(f"[{family}] {len(vocab)} tokens from {sources[family]}", flush=True)
        bench_vocab(family, vocab, rows, args.quick)
    if args.save_vocab is not None:
        return
    print_table(
        rows,
        [
            "vocab",
            "workload",
            "median_ms",
            "min_ms",
            "max_ms",
            "target_ms",
            "meets_target",
            "floor_ms",
            "x_floor",
        ],
    )
    path = write_json(
        "w3_trie",
        {
            "rows": rows,
            "vocab_sources": sources,
            "torch_threads": torch.get_num_threads(),
            "compiled_kernel": _compiled.KERNEL is not None,
        },
        args.out,
    )
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

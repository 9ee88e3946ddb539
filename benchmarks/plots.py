"""One PNG per workload, drawn from the JSON its script wrote (matplotlib, Agg backend).

Every plot shows our result against the floor measured in the same run: medians, with
min/max as error bars where the script recorded them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")

import matplotlib.pyplot as plt


def plot(name: str, payload: dict[str, Any], path: Path) -> Path:
    """Draws workload ``name`` (a key of ``benchmarks.suite.WORKLOADS``) into ``path``."""
    fig = DRAWERS[name](payload)
    machine = payload.get("machine", {})
    where = machine.get("gpu") or f"{machine.get('cpu_count')} CPUs"
    fig.text(
        0.99,
        0.005,
        f"{payload.get('workload')} on {where}",
        ha="right",
        va="bottom",
        fontsize=7,
        color="grey",
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _ratio_axes(ax: Any, xlabel: str, ylabel: str) -> None:
    ax.axhline(1.0, color="black", linewidth=0.8, linestyle="--", label="floor")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)


def _errors(median: list[float], low: list[float], high: list[float]) -> list[list[float]]:
    return [[m - lo for m, lo in zip(median, low)], [hi - m for m, hi in zip(median, high)]]


def draw_w1_vllm(payload: dict[str, Any]) -> Any:
    """W1 and W5 (``bench_smc_vllm``): one panel each, time / floor against N."""
    tables = payload["tables"]
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    for ax, (workload, rows) in zip(axes[0], tables.items()):
        ns = [r["N"] for r in rows]
        ratio = [r["ratio"] for r in rows]
        low = [r["wall_min_s"] / r["floor_s"] for r in rows]
        high = [r["wall_max_s"] / r["floor_s"] for r in rows]
        ax.errorbar(ns, ratio, yerr=_errors(ratio, low, high), marker="o", capsize=3,
                    label="AsyncVirtualLM")
        ax.plot(ns, [r["ratio_nosample"] for r in rows], marker="o", linestyle="--",
                label="less the user's sampling")
        if "peer_ratio" in rows[0]:
            ax.plot(ns, [r["peer_ratio"] for r in rows], marker="s", linestyle=":",
                    label="genlm-backend 0.3.1")
        ax.axhline(1.2, color="red", linewidth=0.8, linestyle=":", label="target, less sampling")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{workload.upper()}: N x T={rows[0]['T']} steps, time / llm.generate")
        _ratio_axes(ax, "particles N", "time / floor (lower is better)")
    return fig


def draw_smc_starts(payload: dict[str, Any]) -> Any:
    """W1 and W5 over engine starts (``bench_smc_starts``): time / floor against N, medians
    across starts with their min and max."""
    tables = payload["tables"]
    fig, axes = plt.subplots(1, len(tables), figsize=(5.5 * len(tables), 4), squeeze=False)
    for ax, (workload, rows) in zip(axes[0], tables.items()):
        ns = [r["N"] for r in rows]
        for key, label, style in (("ratio", "AsyncVirtualLM", "-"),
                                  ("ratio_nosample", "less the user's sampling", "--")):
            median = [r[key] for r in rows]
            low, high = [r[f"{key}_min"] for r in rows], [r[f"{key}_max"] for r in rows]
            ax.errorbar(ns, median, yerr=_errors(median, low, high), marker="o", capsize=3,
                        linestyle=style, label=label)
        if "peer_wall_s" in rows[0]:
            ax.plot(ns, [r["peer_ratio"] for r in rows], marker="s",
                    linestyle=":", label="genlm-backend 0.3.1")
        ax.set_xscale("log", base=2)
        ax.set_title(f"{workload.upper()}: N x T={rows[0]['T']}, {rows[0]['starts']} starts")
        _ratio_axes(ax, "particles N", "time / llm.generate (lower is better)")
    return fig


def draw_heartbeat(payload: dict[str, Any]) -> Any:
    """The heartbeat's worst and 99th-percentile lateness per soak, the idle one first."""
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    labels = [str(r["repeat"]) for r in rows]
    width = 0.4
    for k, stat in enumerate(("max_ms", "p99_ms")):
        xs = [i + (k - 0.5) * width for i in range(len(rows))]
        ax.bar(xs, [r[stat] for r in rows], width, label=stat.removesuffix("_ms"))
    ax.axhline(50, color="red", linestyle=":", label="target: 50 ms")
    ax.set_xticks(range(len(rows)), labels)
    ax.set_xlabel("soak (idle: no clients)")
    ax.set_ylabel("heartbeat lateness, ms (lower is better)")
    ax.set_title(f"Event loop with {payload['clients']} clients on {payload['backend']}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def draw_w1_hf(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    fig, ax = plt.subplots(figsize=(6, 4))
    ns = [r["N"] for r in rows]
    ratio = [r["ratio"] for r in rows]
    paired = [[w / f for w, f in zip(r["wall_times"], r["floor_times"])] for r in rows]
    ax.errorbar(
        ns,
        ratio,
        yerr=_errors(ratio, [min(p) for p in paired], [max(p) for p in paired]),
        marker="o",
        capsize=3,
        label="AsyncTransformer",
    )
    ax.set_xscale("log", base=2)
    ax.set_title(f"W1 HF: N particles x T={rows[0]['T']} steps, time / batched forward loop")
    _ratio_axes(ax, "particles N", "time / floor (lower is better)")
    return fig


def draw_w2(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    variants = [v for v in ("floor", "batch_sample", "sample") if v in rows[0]]
    labels = {
        "floor": "llm.generate (floor)",
        "batch_sample": "batch_sample",
        "sample": "concurrent sample",
    }
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(variants)
    for k, v in enumerate(variants):
        tokens = [r["num_tokens"] for r in rows]
        median = [n / r[v]["median_s"] for n, r in zip(tokens, rows)]
        low = [n / r[v]["max_s"] for n, r in zip(tokens, rows)]
        high = [n / r[v]["min_s"] for n, r in zip(tokens, rows)]
        xs = [i + (k - (len(variants) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, median, width, yerr=_errors(median, low, high), capsize=3, label=labels[v])
    ax.set_xticks(range(len(rows)), [f"P={r['P']}, T={r['T']}" for r in rows])
    ax.set_ylabel("tokens / s (higher is better)")
    ax.set_title("W2: batched sampling throughput")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def draw_w3(payload: dict[str, Any]) -> Any:
    rows = [r for r in payload["rows"] if not r["workload"].startswith("floor")]
    fig, ax = plt.subplots(figsize=(8, 0.3 * len(rows) + 1.5))
    names = [f"{r['vocab']}: {r['workload']}" for r in rows]
    median = [r["median_ms"] for r in rows]
    ys = range(len(rows))
    ax.barh(
        ys,
        median,
        xerr=_errors(median, [r["min_ms"] for r in rows], [r["max_ms"] for r in rows]),
        capsize=2,
        label="median (min/max)",
    )
    floors = [(y, r["floor_ms"]) for y, r in zip(ys, rows) if "floor_ms" in r]
    if floors:
        ax.scatter(
            [f for _, f in floors],
            [y for y, _ in floors],
            marker="|",
            s=200,
            color="black",
            label="floor: writing the output",
            zorder=3,
        )
    targets = [(y, r["target_ms"]) for y, r in zip(ys, rows) if "target_ms" in r]
    if targets:
        ax.scatter(
            [t for _, t in targets],
            [y for y, _ in targets],
            marker="x",
            color="red",
            label="target",
            zorder=3,
        )
    ax.set_yticks(list(ys), names, fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("milliseconds (log)")
    ax.set_title("W3: token-character tries")
    ax.grid(axis="x", alpha=0.3)
    ax.legend(fontsize=7)
    return fig


def draw_w4(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    vocabularies = list(dict.fromkeys(r["vocabulary"] for r in rows))
    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, ax = plt.subplots(figsize=(6, 4))
    width = 0.8 / len(methods)
    for k, method in enumerate(methods):
        picked = [
            next(r for r in rows if r["vocabulary"] == v and r["method"] == method)
            for v in vocabularies
        ]
        median = [r["median_s"] for r in picked]
        xs = [i + (k - (len(methods) - 1) / 2) * width for i in range(len(vocabularies))]
        ax.bar(
            xs,
            median,
            width,
            yerr=_errors(median, [r["min_s"] for r in picked], [r["max_s"] for r in picked]),
            capsize=3,
            label=method,
        )
    if "target_s" in payload:
        ax.axhline(
            payload["target_s"],
            color="red",
            linestyle=":",
            label=f"target {payload['target_s']} s (131k)",
        )
    ax.set_xticks(range(len(vocabularies)), vocabularies, fontsize=8)
    ax.set_ylabel("seconds (lower is better)")
    ax.set_title("W4: decode_vocab")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def draw_memory(payload: dict[str, Any]) -> Any:
    rows = payload["rows"]
    measures = [
        m
        for m in ("tensor", "rss", "cuda_held", "cuda_peak")
        if any(f"{m}_per_1000" in r for r in rows)
    ]
    has_kv = any("kv_per_1000" in r for r in rows)
    fig, axes = plt.subplots(1, 2 if has_kv else 1, figsize=(10 if has_kv else 6, 4), squeeze=False)
    ax = axes[0][0]
    width = 0.8 / len(measures)
    mib = 2**20
    for k, m in enumerate(measures):
        median = [r.get(f"{m}_per_1000", 0) / mib for r in rows]
        low = [r.get(f"{m}_per_1000_min", 0) / mib for r in rows]
        high = [r.get(f"{m}_per_1000_max", 0) / mib for r in rows]
        xs = [i + (k - (len(measures) - 1) / 2) * width for i in range(len(rows))]
        ax.bar(xs, median, width, yerr=_errors(median, low, high), capsize=3, label=m)
    for i, r in enumerate(rows):
        ax.hlines(
            r["floor_bytes_per_1000"] / mib,
            i - 0.45,
            i + 0.45,
            color="black",
            linestyle="--",
            label="floor V*4 B/row" if i == 0 else None,
        )
    ax.set_xticks(range(len(rows)), [f"{r['backend']} n={r['rows']}" for r in rows], fontsize=8)
    ax.set_ylabel("MiB per 1000 cached rows")
    ax.set_title("output cache")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    if has_kv:
        kv_rows = [r for r in rows if "kv_per_1000" in r]
        ax = axes[0][1]
        xs = range(len(kv_rows))
        ax.bar(xs, [r["kv_per_1000"] / mib for r in kv_rows], 0.5, label="kv_cache_bytes")
        for i, r in enumerate(kv_rows):
            ax.hlines(
                r["kv_floor_per_1000"] / mib,
                i - 0.35,
                i + 0.35,
                color="black",
                linestyle="--",
                label="floor: distinct tokens" if i == 0 else None,
            )
        ax.set_xticks(list(xs), [f"{r['backend']} n={r['rows']}" for r in kv_rows], fontsize=8)
        ax.set_ylabel("MiB per 1000 contexts")
        ax.set_title("HF key/value trie")
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Memory per 1000 cached log-probability rows")
    return fig


DRAWERS = {
    "w1-vllm": draw_w1_vllm,
    "smc-starts": draw_smc_starts,
    "w1-hf": draw_w1_hf,
    "w2": draw_w2,
    "w3": draw_w3,
    "w4": draw_w4,
    "memory": draw_memory,
    "heartbeat": draw_heartbeat,
}

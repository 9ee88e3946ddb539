"""The suite's summary: one or more headline rows per workload, read from the JSON it wrote.

Each row is ``case``, ``ours`` and ``floor`` (in ``unit``), ``ratio`` = ours / floor, the
``min``/``max`` of the ratio where the script recorded a spread, and which way is ``better``.
"""

from __future__ import annotations

from typing import Any


def headlines(name: str, payload: dict[str, Any]) -> list[dict[str, Any]]:
    """Summary rows: ``case``, ``ours``, ``floor`` (with ``unit``), ``ratio`` = ours / floor,
    ``min``/``max`` of the ratio where the script recorded a spread, and ``better``."""
    if name == "w1-vllm":
        return [{"workload": name, **line} for line in _smc_lines(payload["tables"])]
    rows = payload["rows"]
    out = []
    if name == "heartbeat":
        idle = next(r for r in rows if r["repeat"] == "idle")
        summary = payload["summary"]
        for stat in ("max_ms", "p99_ms"):
            case = f"{payload['backend']} {payload['clients']} clients, {stat[:-3]} lateness"
            out.append(_line(case, summary[stat], idle[stat], "ms", "lower", None, None))
    elif name == "w1-hf":
        for r in rows:
            paired = [w / f for w, f in zip(r["wall_times"], r["floor_times"])]
            out.append(
                _line(
                    f"N={r['N']} T={r['T']}",
                    r["wall_s"],
                    r["floor_s"],
                    "s",
                    "lower",
                    min(paired),
                    max(paired),
                )
            )
    elif name == "w2":
        for r in rows:
            for v in ("batch_sample", "sample"):
                if f"{v}_tok_s" in r:
                    out.append(
                        _line(
                            f"P={r['P']} T={r['T']} {v}",
                            r[f"{v}_tok_s"],
                            r["floor_tok_s"],
                            "tok/s",
                            "higher",
                            r[f"{v}_ratio_min"],
                            r[f"{v}_ratio_max"],
                        )
                    )
    elif name == "w3":
        for r in rows:
            if "floor_ms" in r:
                out.append(
                    _line(
                        f"{r['vocab']} {r['workload']}",
                        r["median_ms"],
                        r["floor_ms"],
                        "ms",
                        "lower",
                        r["min_ms"] / r["floor_ms"],
                        r["max_ms"] / r["floor_ms"],
                    )
                )
    elif name == "w4":
        baseline = {r["vocabulary"]: r for r in rows if r["method"] != "decode_vocab"}
        for r in rows:
            if r["method"] == "decode_vocab":
                base = baseline[r["vocabulary"]]["median_s"]
                out.append(
                    _line(
                        r["vocabulary"],
                        r["median_s"],
                        base,
                        "s",
                        "lower",
                        r["min_s"] / base,
                        r["max_s"] / base,
                    )
                )
    elif name == "memory":
        for r in rows:
            for m in ("tensor", "rss", "cuda_held", "cuda_peak"):
                if f"{m}_per_1000" in r:
                    floor = r["floor_bytes_per_1000"]
                    out.append(
                        _line(
                            f"{r['backend']} n={r['rows']} {m}",
                            r[f"{m}_per_1000"] / 2**20,
                            floor / 2**20,
                            "MiB/1000 rows",
                            "lower",
                            r[f"{m}_per_1000_min"] / floor,
                            r[f"{m}_per_1000_max"] / floor,
                        )
                    )
            if "kv_per_1000" in r:
                out.append(
                    _line(
                        f"{r['backend']} n={r['rows']} kv cache",
                        r["kv_per_1000"] / 2**20,
                        r["kv_floor_per_1000"] / 2**20,
                        "MiB/1000 ctx",
                        "lower",
                        None,
                        None,
                    )
                )
    return [{"workload": name, **line} for line in out]


def _smc_lines(tables: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """W1/W5: wall time, wall time less the user's own sampling, and 0.3.1's where timed."""
    out = []
    for workload, rows in tables.items():
        for r in rows:
            case, floor = f"{workload.upper()} N={r['N']} T={r['T']}", r["floor_s"]
            low, high = r["wall_min_s"] / floor, r["wall_max_s"] / floor
            out.append(_line(case, r["wall_s"], floor, "s", "lower", low, high))
            nosample = r["ratio_nosample"] * floor
            out.append(_line(f"{case} less sampling", nosample, floor, "s", "lower", None, None))
            if "peer_wall_s" in r:
                peer = r["peer_wall_s"]
                out.append(_line(f"{case} 0.3.1", peer, floor, "s", "lower", None, None))
    return out


def _line(
    case: str,
    ours: float,
    floor: float,
    unit: str,
    better: str,
    low: float | None,
    high: float | None,
) -> dict[str, Any]:
    return {
        "case": case,
        "ours": ours,
        "floor": floor,
        "unit": unit,
        "ratio": ours / floor,
        "min": low,
        "max": high,
        "better": better,
    }

"""Shared timing for the benchmarks: engines interleaved round by round with idle gaps."""
from __future__ import annotations

import json
import math
import statistics
import time
from pathlib import Path
from typing import Callable

GAP_S = 0.05


def elapsed(fn: Callable) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def interleave(engines: dict[str, Callable], runs: int, inner: int = 1, min_s: float = 0.0) -> dict[str, float]:
    """Median seconds per call of each engine. Each round runs every engine once to wake its
    thread pools, then `inner` times, then idles (pools keep spinning after a call and slow
    whatever runs next); the result is the median over rounds of the per-round medians. The
    order turns by one engine each round, so none always follows the same neighbour. At least
    `runs` rounds, more for engines fast enough that `runs` calls of the first take under `min_s`
    (a 20 ms decode step's median over 20 calls moved by 5 % between runs)."""
    samples: dict[str, list] = {k: [] for k in engines}
    for fn in engines.values():
        fn()
    rounds = max(runs, math.ceil(min_s / elapsed(next(iter(engines.values())))))
    names = list(engines)
    for r in range(rounds):
        for k in names[r % len(names):] + names[:r % len(names)]:
            fn = engines[k]
            fn()
            samples[k].append(statistics.median(elapsed(fn) for _ in range(inner)))
            time.sleep(GAP_S)
    return {k: statistics.median(v) for k, v in samples.items()}


def table(rows: list[dict], cols: list[tuple[str, str]]) -> str:
    lines = ["| " + " | ".join(c for c, _ in cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        lines.append("| " + " | ".join(f.format(r[c]) if r.get(c) is not None else "-" for c, f in cols) + " |")
    return "\n".join(lines)


def write(name: str, payload: dict) -> Path:
    out = Path(__file__).parent / "results" / f"{name}.json"
    out.parent.mkdir(exist_ok=True)
    out.write_text(json.dumps(payload, indent=1))
    return out

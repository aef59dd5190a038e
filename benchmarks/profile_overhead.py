"""Cost of the profiler: an accelerated call inside `torchnative.profile()` vs the same call with
profiling off, and profiling off vs a build of Program.__call__ without the profiling check.

    python benchmarks/profile_overhead.py [--workloads gpt2,gpt2-cache,bert-base] [--runs 30]

`gpt2`: tiny config without a KV cache (calls replay); `gpt2-cache`: with a DynamicCache (every
call is recorded at the door); `bert-base`: BERT-base seq 128 on ORT. `on` opens and closes a
profile around each call (the report record included). Engines are interleaved with idle gaps
(benchmarks/common.py). Writes benchmarks/results/profile_overhead.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import sys
import timeit
from pathlib import Path

import torch

from torchnative import events, models
from torchnative.build.program import Program

sys.path.insert(0, str(Path(__file__).parent))
from common import interleave, table, write  # noqa: E402

INNER = 5
WORKLOADS = {"gpt2": ("gpt2", "tiny", 16, {"use_cache": False}), "gpt2-cache": ("gpt2", "tiny", 16, {}),
             "bert-base": ("bert", "base", 128, {})}


def _without_profiling_check(self: Program, inputs: list) -> list:
    """Program.__call__ as it was before the profiler: no `events.timing` test."""
    try:
        with torch.no_grad():
            return self.run_fn(inputs)
    except Exception as e:
        raise self._locate(inputs, e) from e


def bench(name: str, runs: int) -> dict:
    arch, size, seq, extra = WORKLOADS[name]
    model = models.build(arch, size)
    inputs = {**models.example_inputs(arch, model, seq=seq), **extra}
    accel = torchnative.accelerate(models.build(arch, size))
    with_check = Program.__call__

    def eager():
        model(**inputs)

    def off():
        accel(**inputs)

    def on():
        with torchnative.profile():
            accel(**inputs)

    def no_check():
        Program.__call__ = _without_profiling_check
        try:
            accel(**inputs)
        finally:
            Program.__call__ = with_check

    with torch.no_grad():
        for _ in range(3):  # eager tier, compile, replayable
            off()
        torchnative.reset_stats()
        med = interleave({"eager": eager, "off": off, "on": on, "no_check": no_check}, runs, INNER)
        runs_per_call = torchnative.stats()["graph_runs"] / (3 * (1 + runs * (1 + INNER)))  # off, on, no_check
    row = {"workload": name, **{f"{k}_ms": v * 1e3 for k, v in med.items()}}
    row["graph_runs_per_call"] = runs_per_call
    row["on_vs_off"] = med["on"] / med["off"]
    row["off_vs_no_check"] = med["off"] / med["no_check"]
    return row


def micro() -> dict:
    """Nanoseconds of what profiling-off adds per graph run: one flag test."""
    n = 2_000_000
    flag = timeit.timeit("events.timing", globals={"events": events}, number=n) / n * 1e9
    empty = timeit.timeit("pass", number=n) / n * 1e9
    return {"flag_test_ns": flag - empty}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--runs", type=int, default=30)
    a = p.parse_args()
    rows = [bench(w, a.runs) for w in a.workloads.split(",")]
    m = micro()
    print(table(rows, [("workload", "{}"), ("eager_ms", "{:.2f}"), ("off_ms", "{:.3f}"), ("on_ms", "{:.3f}"),
                       ("no_check_ms", "{:.3f}"), ("on_vs_off", "{:.3f}x"), ("off_vs_no_check", "{:.3f}x"),
                       ("graph_runs_per_call", "{:.1f}")]))
    print(f"profiling off adds one flag test per graph run: {m['flag_test_ns']:.1f} ns")
    print(f"wrote {write('profile_overhead', {'torch': torch.__version__, 'rows': rows, **m})}")


if __name__ == "__main__":
    main()

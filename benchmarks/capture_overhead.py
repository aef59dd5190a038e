"""Cost of the door: µs per recorded op above eager, cold and warm, and forward time vs eager and
torch.compile, on transformers models from small configs and on BERT-base.

    python benchmarks/capture_overhead.py [--models gpt2,llama,bert,bert-base] [--runs 30] [--no-compile]

cold_us_per_op: the first call; warm_us_per_op: accelerate's steady calls (replays); recording_us_per_op:
calls recorded through a warm trie (replay off, nothing compiled), each op through the door — all
per recorded op, above eager. Engines are interleaved round by round with idle gaps
(benchmarks/common.py). Writes benchmarks/results/capture_overhead.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import sys
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchnative import models
from torchnative.cache.program_cache import clear_caches

sys.path.insert(0, str(Path(__file__).parent))
from common import elapsed, interleave, table, write  # noqa: E402

INNER = 5
SEQ = {"tiny": 16, "base": 128}


class PassThrough(TorchDispatchMode):
    """The cheapest possible door: a mode that runs every op as it comes."""
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _spec(name: str) -> tuple[str, str]:
    return (name[:-5], "base") if name.endswith("-base") else (name, "tiny")


def bench(name: str, runs: int, with_compile: bool) -> dict:
    arch, size = _spec(name)
    model = models.build(arch, size)
    inputs = models.example_inputs(arch, model, seq=SEQ[size])
    eager = lambda: model(**inputs)  # noqa: E731
    accel_model = torchnative.accelerate(models.build(arch, size))
    accel = lambda: accel_model(**inputs)  # noqa: E731
    # every call recorded through the warm trie (no replay, never compiled): the door's own cost
    recording_model = torchnative.accelerate(models.build(arch, size), replay=False, compile_after=10 ** 9)
    recording = lambda: recording_model(**inputs)  # noqa: E731

    def passthrough():
        with PassThrough():
            model(**inputs)

    row: dict = {"model": name}
    with torch.no_grad():
        eager()
        t_eager_first = min(elapsed(eager) for _ in range(3))
        clear_caches()
        torchnative.reset_stats()
        row["accel_cold_ms"] = elapsed(accel) * 1e3
        ops = torchnative.stats()["ops_recorded"]
        row["ops_recorded"] = ops
        row["graphs"] = torchnative.stats()["graph_runs"]
        row["cold_us_per_op"] = (row["accel_cold_ms"] / 1e3 - t_eager_first) / ops * 1e6
        engines = {"eager": eager, "accelerate": accel, "recording": recording, "passthrough_mode": passthrough}
        if with_compile:
            compiled = torch.compile(model)
            row["compile_first_call_s"] = elapsed(lambda: compiled(**inputs))
            engines["torch.compile"] = lambda: compiled(**inputs)
        med = interleave(engines, runs, INNER)
    row.update({f"{k}_ms": v * 1e3 for k, v in med.items()})
    row["warm_us_per_op"] = (med["accelerate"] - med["eager"]) / ops * 1e6
    row["recording_us_per_op"] = (med["recording"] - med["eager"]) / ops * 1e6
    row["passthrough_us_per_op"] = (med["passthrough_mode"] - med["eager"]) / ops * 1e6
    row["accel_vs_eager"] = med["eager"] / med["accelerate"]
    if "torch.compile" in med:
        row["compile_vs_eager"] = med["eager"] / med["torch.compile"]
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--models", default="gpt2,llama,bert,bert-base")
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    rows = []
    for name in a.models.split(","):
        rows.append(bench(name, a.runs, not a.no_compile))
        print(f"  done {name}", flush=True)
    cols = [("model", "{}"), ("ops_recorded", "{}"), ("graphs", "{}"), ("eager_ms", "{:.2f}"),
            ("accelerate_ms", "{:.2f}"), ("accel_vs_eager", "{:.2f}x"), ("torch.compile_ms", "{:.2f}"),
            ("compile_vs_eager", "{:.2f}x"), ("cold_us_per_op", "{:.0f}"), ("warm_us_per_op", "{:.1f}"), ("recording_us_per_op", "{:.1f}"),
            ("passthrough_us_per_op", "{:.1f}")]
    print(table(rows, cols))
    print(f"wrote {write('capture_overhead', {'torch': torch.__version__, 'rows': rows})}")


if __name__ == "__main__":
    main()

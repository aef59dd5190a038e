"""What fusion into composites (passes.fuse) buys ONNX Runtime: Llama prefill (RMSNorm and RoPE
are composites) under accelerate with the `ort` delegate as it is, and with its composites off,
beside eager and ONNX Runtime standalone, in one run, interleaved with idle gaps.

    python benchmarks/fusion.py [--runs 20] [--workloads llama-prefill]

Writes benchmarks/results/fusion.json.
"""
from __future__ import annotations

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

from torchnative.delegates import REGISTRY

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write  # noqa: E402
from models import bench  # noqa: E402

warnings.filterwarnings("ignore")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="llama-prefill")
    p.add_argument("--runs", type=int, default=20)
    a = p.parse_args()
    unfused = copy.copy(REGISTRY["ort"])
    unfused.name, unfused.composites = "ort-unfused", frozenset()
    REGISTRY[unfused.name] = unfused
    rows = [bench(w, a.runs, ["ort", unfused.name], with_compile=False) for w in a.workloads.split(",")]
    engines = ["eager", "accel[ort]", "accel[ort-unfused]", "ort_standalone"]
    for r in rows:
        r["fused_vs_unfused_x"] = r["accel[ort-unfused]_ms"] / r["accel[ort]_ms"]
    print(table(rows, [("workload", "{}")] + [(f"{e}_ms", "{:.1f}") for e in engines]
                + [(f"{e}_x", "{:.2f}x") for e in engines[1:]] + [("fused_vs_unfused_x", "{:.3f}x")]))
    print(f"wrote {write('fusion', {'torch': torch.__version__, 'rows': rows})}")


if __name__ == "__main__":
    main()

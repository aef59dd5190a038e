"""Op coverage per delegate on the model zoo: of each model's recorded Core ATen ops, how many each
delegate claims (its `supports`, as the partitioner asks), and for delegates that execute here how
many ran in its partitions; the reasons for the ops left out, most frequent first.

    python benchmarks/coverage.py [--delegates coreml,coreai] [--models gpt2,llama,gemma3,bert,vit,resnet]

Prints a table; writes benchmarks/results/coverage.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import sys
import warnings
from collections import Counter
from pathlib import Path

import torch

from torchnative import models
from torchnative.delegates import REGISTRY

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write  # noqa: E402

warnings.filterwarnings("ignore")


def _recorded(name: str):
    """The model's forward as recorded (tiny config, batch 1), and its inputs."""
    model = models.build(name)
    inputs = models.example_inputs(name, model)
    if "input_ids" in inputs and name in ("gpt2", "llama", "gemma3"):
        inputs["use_cache"] = False
    with torch.no_grad(), torchnative.capture(["eager"], compile_after=1, background=False):
        return model, inputs, torchnative.explain(lambda: model(**inputs))


def _row(name: str, delegate: str) -> dict:
    model, inputs, recorded = _recorded(name)
    d = REGISTRY[delegate]
    nodes = [n for g in recorded.graphs for n in g.op_nodes()]
    verdicts = [d.supports(n) for n in nodes]
    left = Counter(f"{n.target}: {v.reason}" for n, v in zip(nodes, verdicts) if not v)
    row = {"model": name, "delegate": delegate, "ops": len(nodes), "claimed": sum(map(bool, verdicts)),
           "left_out": dict(left.most_common(5))}
    if d.available().status == "executes":
        with torch.no_grad(), torchnative.capture([delegate], compile_after=1, background=False):
            e = torchnative.explain(lambda: model(**inputs))
        row["ran"] = sum(k for parts in e.partitions for dd, k in parts if dd == delegate)
        row["fallbacks"] = [f.reason for f in e.fallbacks]
    return row


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--delegates", default="coreml,coreai")
    p.add_argument("--models", default=",".join(sorted(models.BUILDERS)))
    a = p.parse_args()
    rows = [_row(m, d) for m in a.models.split(",") for d in a.delegates.split(",")]
    for r in rows:
        r["claimed %"] = f"{100 * r['claimed'] / max(r['ops'], 1):.0f}"
        r["ran %"] = f"{100 * r['ran'] / max(r['ops'], 1):.0f}" if "ran" in r else "-"
    print(table(rows, [(c, "{}") for c in ("model", "delegate", "ops", "claimed", "claimed %", "ran %")]))
    for r in rows:
        for reason, k in r["left_out"].items():
            print(f"  {r['model']}/{r['delegate']}: {k}x {reason[:150]}")
    print(write("coverage", {"rows": rows}))


if __name__ == "__main__":
    main()

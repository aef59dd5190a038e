"""What checking every partition before it is trusted costs (issue 38, build/verify.py): its share
of each program's build time, GPT-2 small (a forward of 128 tokens and a decode step) and
ResNet-50 (batch 8, 224²) on `ort`, and every partition the check declined.

    python benchmarks/verify_cost.py [--models gpt2,resnet] [--delegates ort]

Prints a table; writes benchmarks/results/verify_cost.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import sys
import warnings
from pathlib import Path

import torch

from torchnative import events, models
from torchnative.cache.program_cache import clear_caches

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write  # noqa: E402

warnings.filterwarnings("ignore")


def _calls(name: str):
    model = models.build(name, "base")
    if name == "resnet":
        x = torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(0))
        return model, [lambda: model(pixel_values=x).last_hidden_state]
    ids = torch.randint(0, 1000, (1, 128), generator=torch.Generator().manual_seed(0))

    def decode():
        out = model(ids, use_cache=True)
        return model(ids[:, -1:], past_key_values=out.past_key_values, use_cache=True).logits
    return model, [lambda: model(ids, use_cache=False).logits, decode]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="gpt2,resnet")
    parser.add_argument("--delegates", default="ort")
    args = parser.parse_args()
    rows, declined = [], []
    for name in args.models.split(","):
        for delegate in args.delegates.split(","):
            clear_caches()
            model, calls = _calls(name)
            built = []
            stop = events.listen(lambda e: built.append(e) if isinstance(e, events.ProgramBuilt) else
                                 declined.append((name, delegate, e.reason)) if isinstance(e, events.Fallback)
                                 and e.reason.startswith("verify") else None)
            try:
                with torch.no_grad(), torchnative.capture([delegate], compile_after=1, background=False):
                    for call in calls:
                        call().sum().item()
            finally:
                stop()
            total = sum(e.seconds for e in built)
            verify = sum(e.program.verify_s for e in built)
            checked = sum(1 for e in built for s in e.program.steps if s.verdict is not None)
            worst = max((s.verdict.gap for e in built for s in e.program.steps if s.verdict is not None), default=0.0)
            rows.append({"model": name, "delegate": delegate, "programs": len(built), "partitions checked": checked,
                         "build s": total, "verify s": verify, "share": verify / total if total else 0.0,
                         "worst gap": worst})
            print(rows[-1], flush=True)
    print(table(rows, [("model", "{}"), ("delegate", "{}"), ("programs", "{}"), ("partitions checked", "{}"),
                       ("build s", "{:.1f}"), ("verify s", "{:.2f}"), ("share", "{:.1%}"), ("worst gap", "{:.1e}")]))
    print("declined:", declined or "none")
    print(f"wrote {write('verify_cost', {'rows': rows, 'declined': declined})}")


if __name__ == "__main__":
    main()

"""Test-time adaptation steps (issue 22): eager vs torch.compile vs torchnative.accelerate on the
same step, in one run, engines interleaved with idle gaps; and the whole step (forward, backward
and optimizer) inside `torchnative.capture` (capture[...]), which records it as one graph.

    python benchmarks/tta.py [--workloads tent,bn-stats,lora,dua] [--runs 8] [--delegates default]

- tent: entropy minimisation, SGD (momentum 0.9) on the BatchNorm affine parameters of ResNet-50
  (transformers ResNetForImageClassification, base config), batch 8, 224x224, batch statistics.
- bn-stats: stage 0, BatchNorm statistics re-estimated on test batches (train mode, no grad).
- lora: one AdamW step of rank-8 LoRA adapters on GPT-2 small's attention projections, seq 128.
- dua: 50 steps of DUA-style BatchNorm re-estimation whose momentum decays every step; counts
  the graphs accelerate built (one per momentum value would be 50).

Each engine owns a copy of the model and its optimizer and runs its own sequence of steps.
Prints steady step time (median over --runs rounds), speed-up over eager, and the first three
steps of each engine relative to an eager step (accelerate records on the first two and compiles
from the second on, in the background (background=True); torch.compile compiles on the first); the steady times
are taken once accelerate's background compiles are done; writes benchmarks/results/tta.json.
torch.compile compiles the model (AOTAutograd compiles its backward); the optimizer runs eagerly.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import copy
import gc
import sys
import time
import warnings
from pathlib import Path
from typing import Callable

import torch

from torchnative.cache.program_cache import clear_caches, programs

sys.path.insert(0, str(Path(__file__).parent))
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")

BATCHES = 4  # distinct test batches, cycled: each step sees new data, none is made inside the timing


def _resnet50() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig())


def _batch_norms(model: torch.nn.Module) -> list[torch.nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def _images() -> list[torch.Tensor]:
    return [torch.randn(8, 3, 224, 224, generator=torch.Generator().manual_seed(i)) for i in range(BATCHES)]


def _tent(model: torch.nn.Module) -> Callable[[], None]:
    model.train().requires_grad_(False)
    params = []
    for bn in _batch_norms(model):
        bn.track_running_stats, bn.running_mean, bn.running_var = False, None, None
        params += [bn.weight.requires_grad_(True), bn.bias.requires_grad_(True)]
    opt = torch.optim.SGD(params, lr=1e-3, momentum=0.9)
    images, i = _images(), 0

    def step():
        nonlocal i
        logits = model(pixel_values=images[i % BATCHES]).logits
        loss = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        i += 1
    return step


def _bn_stats(model: torch.nn.Module) -> Callable[[], None]:
    model.train()
    images, i = _images(), 0

    def step():
        nonlocal i
        with torch.no_grad():
            model(pixel_values=images[i % BATCHES])
        i += 1
    return step


class LoRA(torch.nn.Module):
    """x W + b + (x A) B * scale on a transformers Conv1D (GPT-2's c_attn), B zero at the start."""

    def __init__(self, base: torch.nn.Module, rank: int = 8, alpha: float = 16.0):
        super().__init__()
        self.base, self.scale = base, alpha / rank
        n_in, n_out = base.weight.shape
        self.a = torch.nn.Parameter(torch.randn(n_in, rank) / rank)
        self.b = torch.nn.Parameter(torch.zeros(rank, n_out))

    def forward(self, x):
        return self.base(x) + (x @ self.a) @ self.b * self.scale


def _gpt2_lora() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config()).requires_grad_(False)
    for block in model.transformer.h:
        block.attn.c_attn = LoRA(block.attn.c_attn)
    return model


def _lora(model: torch.nn.Module) -> Callable[[], None]:
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    ids = [torch.randint(0, 50257, (1, 128), generator=torch.Generator().manual_seed(i)) for i in range(BATCHES)]
    i = 0

    def step():
        nonlocal i
        x = ids[i % BATCHES]
        model(input_ids=x, labels=x, use_cache=False).loss.backward()
        opt.step()
        opt.zero_grad()
        i += 1
    return step


WORKLOADS = {"tent": (_resnet50, _tent), "bn-stats": (_resnet50, _bn_stats), "lora": (_gpt2_lora, _lora)}


def _dropout_off(model: torch.nn.Module) -> torch.nn.Module:
    # a dropout mask draws from the generator: every engine would compute something else
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    return model


def _captured(step: Callable[[], None], delegates: list[str] | None) -> Callable[[], None]:
    """The whole step (forward, backward, optimizer) recorded by `capture`: one graph per step."""
    def run():
        with torchnative.capture(delegates, background=True):
            step()
    return run


def _first_steps(step: Callable[[], None], n: int = 3) -> list[float]:
    return [elapsed(step) for _ in range(n)]


def bench(name: str, runs: int, delegates: list[str], with_compile: bool) -> dict:
    factory, method = WORKLOADS[name]
    proto = _dropout_off(factory())
    makers: dict[str, Callable[[], Callable[[], None]]] = {"eager": lambda: method(copy.deepcopy(proto))}
    if with_compile:
        makers["torch.compile"] = lambda: method(torch.compile(copy.deepcopy(proto)))
    for d in delegates:
        chosen = None if d == "default" else [d]
        makers[f"accel[{d}]"] = lambda chosen=chosen: method(torchnative.accelerate(copy.deepcopy(proto), delegates=chosen,
                                                                               background=True))
        makers[f"capture[{d}]"] = lambda chosen=chosen: _captured(method(copy.deepcopy(proto)), chosen)
    row: dict = {"workload": name}
    engines: dict[str, Callable[[], None]] = {}
    for k, make in makers.items():
        try:
            step = make()
            row[f"{k}_first_s"] = _first_steps(step)
            engines[k] = step
        except Exception as e:  # one engine that cannot run the step must not lose the others' figures
            row[f"{k}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        time.sleep(1.0)
    # steady state: accelerate's programs, compiled in the background, in place (a weight the
    # first steps pinned is rebuilt once more)
    for k, step in engines.items():
        if k.startswith(("accel", "capture")):
            for _ in range(3):
                torchnative.wait_for_compiles()
                step()
    torchnative.wait_for_compiles()
    med = interleave(engines, runs)
    for k, v in med.items():
        row[f"{k}_ms"] = v * 1e3
        row[f"{k}_x"] = med["eager"] / v
        row[f"{k}_first_worst_x"] = max(row[f"{k}_first_s"]) / med["eager"]
    engines.clear()
    clear_caches()
    gc.collect()
    return row


def dua(steps: int = 50) -> dict:
    """Graphs accelerate records over `steps` DUA steps, and the compiled ones among them."""
    model = torchnative.accelerate(_resnet50().train())
    images = _images()
    clear_caches()
    torchnative.reset_stats()
    t = time.perf_counter()
    for i in range(steps):
        for bn in _batch_norms(model):
            bn.momentum = max(0.1 * 0.94 ** i, 0.005)
        with torch.no_grad():
            model(pixel_values=images[i % BATCHES])
    seconds = time.perf_counter() - t
    graphs = {p.captured.key for p in programs()}
    compiled = [p for p in programs() if any(d != "eager" for d, _ in p.partitions)]
    row = {"workload": f"dua x{steps}", "graphs": len(graphs), "compiled_programs": len(compiled),
           "seconds": seconds, "graphs_built": torchnative.stats()["graphs_built"]}
    clear_caches()
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="tent,bn-stats,lora,dua")
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--delegates", default="default", help="'default' is accelerate's default set")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    delegates = [d for d in a.delegates.split(",") if d]
    rows, dua_rows = [], []
    for w in a.workloads.split(","):
        try:
            if w == "dua":
                dua_rows.append(dua())
            else:
                rows.append(bench(w, a.runs, delegates, not a.no_compile))
        except Exception as e:
            rows.append({"workload": w, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(f"  done {w}", flush=True)
        write("tta", {"torch": torch.__version__, "rows": rows, "dua": dua_rows, "complete": False})
    engines = ["eager", *([] if a.no_compile else ["torch.compile"]),
               *(f"{way}[{d}]" for d in delegates for way in ("accel", "capture"))]
    for r in rows:
        for e in engines + ["error"]:
            if f"{e}_error" in r or (e == "error" and "error" in r):
                print(f"  {r['workload']} / {e}: {r.get(f'{e}_error', r.get('error'))}")
    cols = [("workload", "{}")] + [(f"{e}_ms", "{:.0f}") for e in engines] + [(f"{e}_x", "{:.2f}x") for e in engines[1:]] \
        + [(f"{e}_first_worst_x", "{:.1f}x") for e in engines[1:]]
    print("steady step ms; speed-up over eager; slowest of the first three steps over an eager step")
    print(table(rows, cols))
    if dua_rows:
        print(table(dua_rows, [("workload", "{}"), ("graphs", "{}"), ("compiled_programs", "{}"), ("seconds", "{:.1f}")]))
    print(f"written to {write('tta', {'torch': torch.__version__, 'rows': rows, 'dua': dua_rows, 'complete': True})}")


if __name__ == "__main__":
    main()

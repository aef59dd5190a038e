"""Test-time adaptation steps (issue 22): eager vs torch.compile vs torchnative.accelerate on the
same step, in one run, engines interleaved with idle gaps; and the whole step (forward, backward
and optimizer) inside `torchnative.capture` (capture[...]), which records it as one graph.

    python benchmarks/tta.py [--workloads tent,bn-stats,lora,dua] [--runs 8] [--delegates default]
                             [--warmup 20] [--no-compile]

- tent: entropy minimisation, SGD (momentum 0.9) on the BatchNorm affine parameters of ResNet-50
  (transformers ResNetForImageClassification, base config), batch 8, 224x224, batch statistics.
- bn-stats: stage 0, BatchNorm statistics re-estimated on test batches (train mode, no grad).
- lora: one AdamW step of rank-8 LoRA adapters on GPT-2 small's attention projections, seq 128.
- dua: 50 steps of DUA-style BatchNorm re-estimation whose momentum decays every step; counts
  the graphs accelerate built (one per momentum value would be 50).

Each engine owns a copy of the model and its optimizer and runs its own sequence of steps.
Prints steady step time (median over --runs rounds), speed-up over eager, and the first three
steps of each engine relative to an eager step (accelerate records on the first two and compiles
from the second on, in the background (background=True); torch.compile compiles on the first); for
accelerate and capture, steps 4 to --warmup as they come (its compiles not waited for: the slowest
over an eager step, and all of them as a speed-up over eager); the steady times are taken once
accelerate's background compiles are done; writes benchmarks/results/tta.json.
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


# -- methods as public TTA libraries write them (issue 42): a method object around the model, the
# model's BatchNorm layers configured at set-up, `model.eval()` in forward, momentum by keyword,
# an EMA teacher through `.data =` ---------------------------------------------------------------
def _resnet18() -> torch.nn.Module:
    """ResNet-18 (torchvision's widths, 11.2 M parameters with 10 classes). ResNetConfig's default
    widths are ResNet-50's (256..2048): with them this was a 178 M-parameter "ResNet-18", every
    figure of the -r18 workloads before 2026-12-07 was measured on it."""
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(embedding_size=64, hidden_sizes=[64, 128, 256, 512],
                                                     depths=[2, 2, 2, 2], layer_type="basic", num_labels=10))


def _rtdetr() -> torch.nn.Module:
    """RT-DETR from a small config (2.1 M parameters): a ResNet backbone (its BatchNorms frozen, as
    transformers makes them), a hybrid encoder with BatchNorms, deformable attention in the decoder."""
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig
    torch.manual_seed(0)
    backbone = RTDetrResNetConfig(depths=[1, 1, 1, 1], hidden_sizes=[32, 64, 128, 256], embedding_size=32,
                                  layer_type="basic", out_features=["stage2", "stage3", "stage4"])
    return RTDetrForObjectDetection(RTDetrConfig(
        backbone_config=backbone, d_model=64, encoder_hidden_dim=64, encoder_in_channels=[64, 128, 256],
        encoder_ffn_dim=128, decoder_ffn_dim=128, num_queries=30, decoder_layers=2, encoder_layers=1,
        num_labels=10, decoder_in_channels=[64, 64, 64], encoder_attention_heads=4, decoder_attention_heads=4,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0))


def _small_images(model: torch.nn.Module) -> list[torch.Tensor]:
    # RT-DETR's three feature levels need a side a multiple of 32; ResNet-18 takes 96x96
    side, batch = (128, 2) if type(model).__name__.startswith("RTDetr") else (96, 4)
    dtype = next(model.parameters()).dtype  # float64 for the reference run of a sensitive method
    return [torch.randn(batch, 3, side, side, generator=torch.Generator().manual_seed(i)).to(dtype) for i in range(BATCHES)]


class Norm(torch.nn.Module):
    """NORM (Schneider et al.): BatchNorm on the test batch's statistics, no gradient."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        for bn in _batch_norms(model):
            bn.train()
            bn.track_running_stats, bn.running_mean, bn.running_var = False, None, None

    @torch.no_grad()
    def forward(self, x):
        return self.model(pixel_values=x).logits


class Tent(torch.nn.Module):
    """TENT (Wang et al.): entropy minimisation on the BatchNorm affine parameters, batch statistics."""

    def __init__(self, model, lr: float = 1e-3):
        super().__init__()
        self.model = model.train().requires_grad_(False)
        params = []
        for bn in _batch_norms(model):
            bn.track_running_stats, bn.running_mean, bn.running_var = False, None, None
            params += [bn.weight.requires_grad_(True), bn.bias.requires_grad_(True)]
        self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9)

    def forward(self, x):
        logits = self.model(pixel_values=x).logits
        loss = -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return logits.detach()


class DuaNorm(torch.nn.BatchNorm2d):
    """DUA's BatchNorm: running statistics moved by the method's decaying momentum (by keyword)."""
    momentum_now = 0.1

    def forward(self, x):
        m = self.momentum_now
        self.running_mean.mul_(1 - m).add_(x.mean((0, 2, 3)), alpha=m)
        self.running_var.mul_(1 - m).add_(x.var((0, 2, 3)), alpha=m)
        return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, False,
                                              0.0, self.eps)


class Dua(torch.nn.Module):
    """DUA (Mirza et al.): every call decays the momentum, updates the statistics on the batch, predicts."""

    def __init__(self, model, decay: float = 0.94, floor: float = 0.005):
        super().__init__()
        self.model, self.decay, self.floor, self.mom = model, decay, floor, 0.1
        for bn in _batch_norms(model):
            bn.__class__ = DuaNorm

    @torch.no_grad()
    def forward(self, x):
        self.model.eval()
        self.mom = max(self.mom * self.decay, self.floor)
        for bn in _batch_norms(self.model):
            bn.momentum_now = self.mom
        return self.model(pixel_values=x).logits


class DuaSteps(torch.nn.Module):
    """DUA as its authors' code runs it: the BatchNorms alone in train mode with the decayed
    momentum (torch's own BatchNorm, `bn.momentum = m`) for a call that moves their statistics,
    then the model in eval mode for the prediction: two calls per step."""

    def __init__(self, model, decay: float = 0.94, floor: float = 0.005):
        super().__init__()
        self.model, self.decay, self.floor, self.mom = model, decay, floor, 0.1

    @torch.no_grad()
    def forward(self, x):
        self.model.eval()
        self.mom = self.mom * self.decay
        for bn in _batch_norms(self.model):
            bn.train()
            bn.momentum = self.mom + self.floor
        self.model(pixel_values=x)
        self.model.eval()
        return self.model(pixel_values=x).logits


class ActMad(torch.nn.Module):
    """ActMAD (Mirza et al.): every BatchNorm's output statistics pulled to the clean ones by SGD
    on all parameters; the model in eval mode, statistics gathered by forward hooks."""

    def __init__(self, model, lr: float = 1e-4):
        super().__init__()
        self.model = model
        self.feats: list[torch.Tensor] = []
        self.clean = []
        for bn in _batch_norms(model):
            bn.register_forward_hook(lambda m, i, o: self.feats.append(o))
            self.clean.append((torch.zeros(bn.num_features), torch.ones(bn.num_features)))
        self.opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def forward(self, x):
        self.model.eval()
        self.feats.clear()
        logits = self.model(pixel_values=x).logits
        loss = sum(torch.nn.functional.l1_loss(f.mean((0, 2, 3)), m) + torch.nn.functional.l1_loss(f.var((0, 2, 3)), v)
                   for f, (m, v) in zip(self.feats, self.clean))
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        return logits.detach()


class MeanTeacher(torch.nn.Module):
    """A mean teacher (as in CoTTA/RMT): the student learns the teacher's predictions (symmetric
    cross-entropy) on BatchNorm affine parameters; the teacher follows by EMA through `.data =`."""

    def __init__(self, model, alpha: float = 0.999, lr: float = 1e-3):
        super().__init__()
        self.student, self.alpha = model.train(), alpha
        self.teacher = copy.deepcopy(model)
        self.student.requires_grad_(False)
        params = [p for bn in _batch_norms(self.student) for p in (bn.weight, bn.bias)]
        for p in params:
            p.requires_grad_(True)
        self.opt = torch.optim.SGD(params, lr=lr, momentum=0.9)

    def forward(self, x):
        with torch.no_grad():
            target = self.teacher(pixel_values=x).logits
        logits = self.student(pixel_values=x).logits
        loss = -(target.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()
        self.opt.zero_grad()
        loss.backward()
        self.opt.step()
        for t_p, s_p in zip(self.teacher.parameters(), self.student.parameters()):
            t_p.data = self.alpha * t_p.data + (1 - self.alpha) * s_p.data
        return target


def _library(method_class) -> Callable[[torch.nn.Module], Callable[[], torch.Tensor]]:
    def make(model: torch.nn.Module) -> Callable[[], torch.Tensor]:
        method, images, i = method_class(model), _small_images(model), 0

        def step():
            nonlocal i
            i += 1
            return method(images[(i - 1) % BATCHES])
        return step
    return make


WORKLOADS = {"tent": (_resnet50, _tent), "bn-stats": (_resnet50, _bn_stats), "lora": (_gpt2_lora, _lora),
             "tent-r18": (_resnet18, _library(Tent)), "norm-r18": (_resnet18, _library(Norm)),
             "dua-r18": (_resnet18, _library(Dua)), "dua-steps-r18": (_resnet18, _library(DuaSteps)),
             "actmad-r18": (_resnet18, _library(ActMad)), "mean-teacher-r18": (_resnet18, _library(MeanTeacher)),
             "norm-detr": (_rtdetr, _library(Norm)), "dua-detr": (_rtdetr, _library(Dua)),
             "dua-steps-detr": (_rtdetr, _library(DuaSteps)),
             "actmad-detr": (_rtdetr, _library(ActMad)), "mean-teacher-detr": (_rtdetr, _library(MeanTeacher))}
LIBRARY = [w for w in WORKLOADS if w.endswith(("-r18", "-detr"))]


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
            out = step()
        return out  # alive when the block ends, so computed (a step returning logits nothing else reads)
    return run


def _first_steps(step: Callable[[], None], n: int = 3) -> list[float]:
    return [elapsed(step) for _ in range(n)]


def bench(name: str, runs: int, delegates: list[str], with_compile: bool, warmup: int = 20) -> dict:
    """Steady step times (interleaved), and each engine's first `warmup` steps as a user meets
    them: compiles in the background not waited for."""
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
            row[f"{k}_first_s"] = _first_steps(step, warmup if k.startswith(("accel", "capture")) else 3)
            engines[k] = step
        except Exception as e:  # one engine that cannot run the step must not lose the others' figures
            row[f"{k}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        time.sleep(1.0)
    # steady state: accelerate's programs, compiled in the background, in place (the cost rule
    # compiles after a few runs, a weight the first steps pinned is rebuilt once more, then a
    # replay autograd records makes its backward's programs)
    for k, step in list(engines.items()):
        try:
            for _ in range(8 if k.startswith(("accel", "capture")) else 2):
                torchnative.wait_for_compiles()
                step()
        except Exception as e:  # an engine that fails later (torch.compile recompiling) loses only its own row
            row[f"{k}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
            del engines[k]
    torchnative.wait_for_compiles()
    med = interleave(engines, runs)
    for k, v in med.items():
        row[f"{k}_ms"] = v * 1e3
        row[f"{k}_x"] = med["eager"] / v
        first = row[f"{k}_first_s"]
        row[f"{k}_first_worst_x"] = max(first[:3]) / med["eager"]
        if len(first) > 3:  # the steps after the first three, while programs compile beside them
            row[f"{k}_warmup_worst_x"] = max(first[3:]) / med["eager"]
            row[f"{k}_warmup_x"] = med["eager"] * len(first) / sum(first)
    engines.clear()
    clear_caches()
    gc.collect()
    return row


def _gap(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.to(got.dtype)
    return float((got - want).abs().max() / want.abs().max().clamp_min(1e-12))


def exactness(name: str, delegates: list[str], steps: int = 20) -> dict:
    """`steps` steps of eager and of accelerate on fresh copies, output by output: the worst
    relative gap, the graphs built and the calls replayed. RT-DETR's top-k query selection turns
    a rounding difference into other queries, so its methods are also run in float64: the gap
    of eager's float32 run to it says how far rounding alone moves the method."""
    factory, method = WORKLOADS[name]
    proto = _dropout_off(factory())
    eager = method(copy.deepcopy(proto))
    row: dict = {"workload": name}
    if name.endswith("-detr"):
        e64, e32 = method(copy.deepcopy(proto).double()), method(copy.deepcopy(proto))
        row["eager_gap"] = max(_gap(e32(), e64()) for _ in range(steps))
    for d in delegates:
        clear_caches()
        torchnative.reset_stats()
        accel = method(torchnative.accelerate(copy.deepcopy(proto), delegates=None if d == "default" else [d],
                                              background=False))
        worst = 0.0
        for _ in range(steps):
            want, got = eager(), accel()
            worst = max(worst, _gap(got, want))
        stats = torchnative.stats()
        row.update({f"{d}_gap": worst, f"{d}_graphs": len({p.captured.key for p in programs()}),
                    f"{d}_built": stats["graphs_built"], f"{d}_replays": stats["replays"],
                    f"{d}_not_replayed": "; ".join(f"{k} ({n})" for k, n in stats["replay_ineligible"].items())})
        eager = method(copy.deepcopy(proto))  # the next delegate's eager from the start too
    clear_caches()
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
    p.add_argument("--workloads", default="tent,bn-stats,lora,dua," + ",".join(LIBRARY))
    p.add_argument("--runs", type=int, default=8)
    p.add_argument("--delegates", default="default", help="'default' is accelerate's default set")
    p.add_argument("--no-compile", action="store_true")
    p.add_argument("--warmup", type=int, default=20, help="first steps timed as they come, compiles not waited for")
    a = p.parse_args()
    delegates = [d for d in a.delegates.split(",") if d]
    rows, dua_rows, exact_rows = [], [], []
    for w in a.workloads.split(","):
        try:
            if w == "dua":
                dua_rows.append(dua())
            else:
                if w in LIBRARY:
                    exact_rows.append(exactness(w, delegates))
                rows.append(bench(w, a.runs, delegates, not a.no_compile, a.warmup))
        except Exception as e:
            rows.append({"workload": w, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(f"  done {w}", flush=True)
        write("tta", {"torch": torch.__version__, "rows": rows, "dua": dua_rows, "exact": exact_rows, "complete": False})
    engines = ["eager", *([] if a.no_compile else ["torch.compile"]),
               *(f"{way}[{d}]" for d in delegates for way in ("accel", "capture"))]
    for r in rows:
        for e in engines + ["error"]:
            if f"{e}_error" in r or (e == "error" and "error" in r):
                print(f"  {r['workload']} / {e}: {r.get(f'{e}_error', r.get('error'))}")
    cols = [("workload", "{}")] + [(f"{e}_ms", "{:.0f}") for e in engines] + [(f"{e}_x", "{:.2f}x") for e in engines[1:]] \
        + [(f"{e}_first_worst_x", "{:.1f}x") for e in engines[1:]] \
        + [(f"{e}_{c}", "{:.2f}x") for e in engines[1:] if e != "torch.compile" for c in ("warmup_worst_x", "warmup_x")]
    print("steady step ms; speed-up over eager; slowest of the first three steps over an eager step; "
          f"of steps 4-{a.warmup} (compiles not waited for) the slowest over an eager step, and all {a.warmup} "
          "as a speed-up over eager")
    print(table(rows, cols))
    if dua_rows:
        print(table(dua_rows, [("workload", "{}"), ("graphs", "{}"), ("compiled_programs", "{}"), ("seconds", "{:.1f}")]))
    if exact_rows:
        print("20 steps against eager's: worst output gap (relative), graphs, programs built, replayed calls;\n"
              "eager_gap: eager's own float32 run against float64 (how far rounding alone moves the method)")
        print(table(exact_rows, [("workload", "{}"), ("eager_gap", "{:.1e}")] + [(f"{d}_{k}", f) for d in delegates for k, f in
                                                         (("gap", "{:.1e}"), ("graphs", "{}"), ("built", "{}"),
                                                          ("replays", "{}"))]))
        for r in exact_rows:
            for d in delegates:
                if r.get(f"{d}_not_replayed"):
                    print(f"  {r['workload']} [{d}] not replayed: {r[f'{d}_not_replayed']}")
    print(f"written to {write('tta', {'torch': torch.__version__, 'rows': rows, 'dua': dua_rows, 'exact': exact_rows, 'complete': True})}")


if __name__ == "__main__":
    main()

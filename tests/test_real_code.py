"""Patterns of real model code (TTA libraries, mean teachers, fast-weight layers, vision
pipelines) under `accelerate`, each run eagerly and accelerated from identical copies over enough
calls to reach the compiled path (a graph compiles after it has run twice) and replay, and checked
against eager after every call: outputs, then every parameter and buffer."""
from __future__ import annotations

import copy
import io
import pickle
import threading
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np
import pytest
import torch

import torchnative
from tests.conftest import assert_same

CALLS = 6
DELEGATES = ["eager", "ort"]


class Net(torch.nn.Module):
    """A small CNN classifier with BatchNorm (what TTA methods adapt)."""

    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.head = torch.nn.Linear(8, 5)
        self.scale = 1.0  # a Python float some patterns change between calls

    def forward(self, x):
        h = torch.relu(self.bn(self.conv(x)))
        return self.head(h.mean((2, 3))) * self.scale


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))


@dataclass
class Pattern:
    name: str
    step: Callable[[Any, torch.Tensor, int], Any]  # (state, x, call) -> output
    setup: Callable[[torch.nn.Module], Any] = lambda m: m  # the state steps share, from the model


def _plain(m, x, i):
    with torch.no_grad():
        return m(x)


def _ema_data(pair, x, i):
    """Mean teacher: the teacher's weights are an EMA of the student's, assigned through `.data`."""
    student, teacher = pair
    with torch.no_grad():
        for s in student.parameters():
            s.add_(0.1 * (i + 1))
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.data = 0.9 * t.data + 0.1 * s.data
        return teacher(x), student(x)


def _ema_inplace(pair, x, i):
    student, teacher = pair
    with torch.no_grad():
        for s in student.parameters():
            s.add_(0.1 * (i + 1))
        for t, s in zip(teacher.parameters(), student.parameters()):
            t.mul_(0.9).add_(s, alpha=0.1)
        return teacher(x), student(x)


def _teacher_of(m):
    return m, copy.deepcopy(m)


def _copy_then_change(m, x, i):
    """A TTA library copies the model it is given (each episode), then adapts the copy."""
    c = copy.deepcopy(m)
    with torch.no_grad():
        for p in c.parameters():
            p.mul_(i)
        return c(x), m(x)


def _pickled(m, x, i):
    buffer = io.BytesIO()
    torch.save(m, buffer)
    c = pickle.loads(pickle.dumps(m)) if i % 2 else torch.load(io.BytesIO(buffer.getvalue()), weights_only=False)
    with torch.no_grad():
        c.head.weight.mul_(i + 1)
        return c(x), m(x)


def _load_state_dict(m, x, i):
    state = {k: v + i if v.is_floating_point() else v for k, v in m.state_dict().items()}
    m.load_state_dict(state, assign=bool(i % 2))
    with torch.no_grad():
        return m(x)


def _new_parameter(m, x, i):
    m.head.weight = torch.nn.Parameter(torch.full_like(m.head.weight, 0.01 * i))
    with torch.no_grad():
        return m(x)


def _hooks(m, x, i):
    seen = []
    handle = m.conv.register_forward_hook(lambda mod, args, out: seen.append(out.sum().item()))
    with torch.no_grad():
        out = m(x)
    handle.remove()
    return out, torch.tensor(seen)


def _record_function(m, x, i):
    class Profiled(torch.nn.Module):
        def forward(self, x):
            with torch.autograd.profiler.record_function("head"):
                return m(x)
    with torch.no_grad():
        return Profiled()(x)


def _train_eval(m, x, i):
    m.train(i % 2 == 0)  # BN uses (and updates) batch statistics in train mode only
    with torch.no_grad():
        return m(x)


def _decaying_float(m, x, i):
    m.scale = 0.5 ** i  # a momentum or temperature that decays every call
    with torch.no_grad():
        return m(x)


def _requires_grad_toggled(m, x, i):
    """Which parameters train is switched between calls (the BN affine alone, as TENT does, or
    the head too)."""
    m.requires_grad_(False)
    m.bn.requires_grad_(True)
    m.head.requires_grad_(i % 2 == 0)
    out = m(x)
    out.sum().backward()
    grads = [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
    m.zero_grad(set_to_none=True)
    return out.detach(), grads


def _pseudo_labels(m, x, i):
    """Confident predictions select the samples a TTA step adapts on (a boolean mask)."""
    with torch.no_grad():
        logits = m(x)
        probs = logits.softmax(1)
        keep = probs.max(1).values > probs.max(1).values.median()
        return logits[keep], probs.argmax(1)[keep]


def _numpy_and_pil(m, x, i):
    """What torchvision's ToPILImage and metrics code do with intermediate tensors."""
    from PIL import Image

    with torch.no_grad():
        h = m.conv(x)
        image = np.asarray(Image.fromarray(h[0, :3].permute(1, 2, 0).mul(40).clamp(0, 255).byte().numpy(force=True)))
        return m(x), torch.from_numpy(image.copy()), torch.from_numpy(h[1].transpose(0, 1).numpy().copy())


def _grad_modes_mixed(m, x, i):
    if i % 3 == 0:
        with torch.inference_mode():
            return m(x).clone()
    if i % 3 == 1:
        with torch.no_grad():
            return m(x)
    return m(x).detach()


def _two_threads(m, x, i):
    outs = [None, None]

    def call(k):
        with torch.no_grad():
            outs[k] = m(x + k)
    threads = [threading.Thread(target=call, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return outs


def _functorch(m, x, i):
    """torch.func over the model between plain calls: batched per sample (vmap) and the input's
    gradient (grad). Transformed calls run as eager (their tensors are the transform's wrappers);
    the old code failed in both."""
    with torch.no_grad():
        plain = m(x)
    per_sample = torch.func.vmap(m)(x.unsqueeze(1))
    grad = torch.func.grad(lambda x: m(x).square().sum())(x)
    return plain, per_sample, grad


PATTERNS = [
    Pattern("plain", _plain),
    Pattern("ema teacher via .data", _ema_data, _teacher_of),
    Pattern("ema teacher in place", _ema_inplace, _teacher_of),
    Pattern("deepcopy after accelerate", _copy_then_change),
    Pattern("pickle and torch.save round trip", _pickled),
    Pattern("load_state_dict between calls", _load_state_dict),
    Pattern("a new nn.Parameter between calls", _new_parameter),
    Pattern("forward hooks added and removed", _hooks),
    Pattern("record_function inside forward", _record_function),
    Pattern("train and eval toggled", _train_eval),
    Pattern("a Python float that decays", _decaying_float),
    Pattern("requires_grad_ toggled", _requires_grad_toggled),
    Pattern("boolean-mask pseudo-labels", _pseudo_labels),
    Pattern("numpy and PIL of intermediates", _numpy_and_pil),
    Pattern("no_grad and inference_mode mixed", _grad_modes_mixed),
    Pattern("torch.func transforms between calls", _functorch, lambda m: m.eval()),
    # eval: in train mode the order of the threads' running-stat updates decides the result, in eager too
    Pattern("called from two threads", _two_threads, lambda m: m.eval()),
]


def _tolerance(delegate: str) -> dict:
    # eager runs the recorded aten ops themselves; ONNX Runtime's kernels round differently
    return dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("delegate", DELEGATES)
@pytest.mark.parametrize("pattern", PATTERNS, ids=lambda p: p.name)
def test_real_code_pattern_matches_eager(pattern, delegate):
    torch.manual_seed(0)
    model = Net()
    eager_state = pattern.setup(copy.deepcopy(model))
    accelerated = torchnative.accelerate(copy.deepcopy(model), delegates=[delegate])
    accel_state = pattern.setup(accelerated)
    tol = _tolerance(delegate)
    for i in range(CALLS):
        x = _x(i)
        expected = pattern.step(eager_state, x, i)
        got = pattern.step(accel_state, x, i)
        assert_same(got, expected, **tol)
    models = lambda s: s if isinstance(s, tuple) else (s,)  # noqa: E731
    for e, a in zip(models(eager_state), models(accel_state)):
        assert_same(dict(a.state_dict()), dict(e.state_dict()), **tol)


def test_a_copy_made_before_accelerate_stays_eager_and_independent():
    torch.manual_seed(0)
    model = Net().eval()
    twin = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"])
    x = _x(0)
    with torch.no_grad():
        for _ in range(CALLS):
            assert_same(model(x), twin(x), **_tolerance("ort"))
    assert "forward" not in twin.__dict__


def test_a_deep_copy_runs_its_own_weights_on_the_compiled_path():
    """The case reported: the copy's forward was the original's closure, so a copy with zeroed
    weights returned the original's values (up to 0.72, eager 0)."""
    torch.manual_seed(0)
    model = torchnative.accelerate(Net().eval(), delegates=["ort"])
    x = _x(0)
    with torch.no_grad():
        for _ in range(CALLS):
            model(x)  # compiled and replayed by now
        twin = copy.deepcopy(model)
        for p in twin.parameters():
            p.zero_()
        for _ in range(CALLS):
            assert torch.equal(twin(x), torch.zeros(4, 5))
            assert not torch.equal(model(x), torch.zeros(4, 5))
    torchnative.deaccelerate(twin)
    assert "forward" not in twin.__dict__


def test_weights_swapped_through_data_are_never_run_stale():
    """An EMA teacher's `p.data = new` keeps each Parameter and its version: only the address
    says the weights changed, and ONNX Runtime reads weights by address (off by 16-64 before)."""
    torch.manual_seed(0)
    model = torchnative.accelerate(Net().eval(), delegates=["ort"])
    reference = copy.deepcopy(model)
    torchnative.deaccelerate(reference)
    x = _x(0)
    with torch.no_grad():
        for i in range(CALLS):
            for p, q in zip(model.parameters(), reference.parameters()):
                new = torch.randn_like(p)
                p.data, q.data = new.clone(), new.clone()
            assert_same(model(x), reference(x), **_tolerance("ort"))

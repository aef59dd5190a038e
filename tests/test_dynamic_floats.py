"""Float module attributes set between calls (DUA's momentum), followed through recorded calls
(replay/floats.py): calls replay with the floats computed again from the attributes, and equal
eager's however Python uses them — arithmetic, branches, conversions, C code it cannot follow."""
from __future__ import annotations

import copy
import math

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative.cache.program_cache import clear_caches, programs

CALLS = 12


class DuaNorm(torch.nn.BatchNorm2d):
    """DUA's BatchNorm as the library writes it: `1 - m` and `alpha=m` from an attribute."""
    momentum_now = 0.1

    def forward(self, x):
        m = self.momentum_now
        for stat, batch in ((self.running_mean, x.mean((0, 2, 3))), (self.running_var, x.var((0, 2, 3)))):
            stat.mul_(1 - m).add_(batch, alpha=m)
        return torch.nn.functional.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias,
                                              eps=self.eps)


class Net(torch.nn.Module):
    def __init__(self, norm=DuaNorm, train: bool | None = False):
        super().__init__()
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3, padding=1), norm(8)
        self.conv2, self.bn2 = torch.nn.Conv2d(8, 8, 3), norm(8)
        self.head = torch.nn.Linear(8, 5)
        self.adapting = train

    def forward(self, x):
        if self.adapting is not None:
            self.train(self.adapting)  # as DUA's forward does every call: changes nothing
        h = self.bn2(self.conv2(torch.relu(self.bn(self.conv(x)))))
        return self.head(h.mean((2, 3)))


class Scaled(torch.nn.Module):
    """A float attribute `use` reads as a test has it (a temperature, a gate)."""

    def __init__(self, use):
        super().__init__()
        self.lin, self.t, self.use = torch.nn.Linear(8, 8), 0.5, use

    def forward(self, x):
        return self.use(self, self.lin(x))


def _dua_momenta(model, i):
    m = max(0.1 * 0.94 ** i, 0.005)
    model.bn.momentum_now = model.bn2.momentum_now = m


def _bn_momenta(model, i):
    model.bn.momentum = model.bn2.momentum = max(0.1 * 0.94 ** i, 0.005)


def _diverging(model, i):
    # one momentum for both until the sixth call, then each its own
    model.bn.momentum_now = 0.1 * 0.9 ** i
    model.bn2.momentum_now = 0.1 * 0.9 ** i if i < 6 else 0.05 * 0.8 ** i


def _temperature(model, i):
    model.t = 0.5 + 0.05 * i


def _creeping(model, i):
    model.t = 0.5 + 0.001 * i  # int(10 t) stays 5


def _flip(model, i):
    model.t = 0.2 + 0.02 * i  # crosses 0.3 at the sixth call


CASES = {
    # (model, set before each call, whether calls replay)
    "dua": (lambda: Net(), _dua_momenta, True),
    # torch's BatchNorm in train mode, its `momentum` set every call (DUA's own code)
    "BatchNorm momentum": (lambda: Net(torch.nn.BatchNorm2d, train=True), _bn_momenta, True),
    "momenta that diverge": (lambda: Net(), _diverging, True),
    "temperature": (lambda: Scaled(lambda m, h: h / m.t + (1 - m.t) * 2), _temperature, True),
    "a branch on the float": (lambda: Scaled(lambda m, h: h * m.t if m.t > 0.3 else h - m.t), _flip, True),
    "math.exp of it (C reads it)": (lambda: Scaled(lambda m, h: h * math.exp(m.t)), _temperature, False),
    "rounded": (lambda: Scaled(lambda m, h: h * round(m.t, 1)), _creeping, True),
    "a size from it": (lambda: Scaled(lambda m, h: h[:, :int(m.t * 10) % 8 + 1].sum(-1)), _creeping, True),
    # its text is checked to be the same: a new value every call never replays
    "its text as a key": (lambda: Scaled(lambda m, h: h * {"0.5": 2.0}.get(f"{m.t}", 3.0)), _temperature, False),
    "set inside the forward": (lambda: Scaled(lambda m, h: (setattr(m, "t", m.t * 0.9), h * m.t)[1]), _temperature,
                               False),
}


def _x(i: int) -> torch.Tensor:
    return torch.randn(4, 3, 8, 8, generator=torch.Generator().manual_seed(i))


@pytest.mark.parametrize("delegate", ["eager", "ort"])
@pytest.mark.parametrize("case", list(CASES))
def test_float_attributes_set_between_calls_equal_eager(case, delegate):
    make, before_call, replays = CASES[case]
    torch.manual_seed(0)
    model = make()
    eager, accelerated = copy.deepcopy(model), torchnative.accelerate(copy.deepcopy(model), delegates=[delegate])
    tol = dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-5, atol=1e-5)
    torchnative.reset_stats()
    for i in range(CALLS):
        x = _x(i) if isinstance(model, Net) else _x(i)[:, 0, 0]
        for m in (eager, accelerated):
            before_call(m, i)
        with torch.no_grad():
            want, got = eager(x), accelerated(x)
        assert_same(got, want, **tol)
        assert_same(dict(accelerated.state_dict()), dict(eager.state_dict()), **tol)
        assert {k: v for k, v in vars(accelerated).items() if type(v) is float} == \
            {k: v for k, v in vars(eager).items() if type(v) is float}
    stats = torchnative.stats()
    assert stats["replays"] >= 2 if replays else stats["replays"] == 0, stats


def test_a_float_attribute_left_by_a_replay_is_a_plain_float():
    """What the forward keeps of a followed float (an output, an attribute) is a plain float."""
    model = torchnative.accelerate(Scaled(lambda m, h: h * m.t), delegates=["eager"])
    for i in range(6):
        model.t = 0.1 * i
        with torch.no_grad():
            model(torch.ones(2, 8))
        assert type(model.t) is float


def _steady_then_change(model, i):
    model.t = 0.5 + (0.0 if i < 6 else 0.05 * i)  # set every call (a new object), the same value for six calls


@pytest.mark.parametrize("use", [lambda m, h: h * torch.tensor(m.t), lambda m, h: h * math.exp(m.t)],
                         ids=["torch.tensor of it", "math.exp of it"])
def test_a_constant_made_of_a_float_that_held_still_is_not_replayed_stale(use):
    """Set to one value for six calls, a constant made of the attribute (by C code no expression
    follows) replays; at the first new value the replay must not reuse it."""
    torch.manual_seed(0)
    model = Scaled(use)
    eager, accelerated = copy.deepcopy(model), torchnative.accelerate(copy.deepcopy(model), delegates=["eager"])
    torchnative.reset_stats()
    for i in range(CALLS):
        for m in (eager, accelerated):
            _steady_then_change(m, i)
        x = _x(i)[:, 0, 0]
        with torch.no_grad():
            assert_same(accelerated(x), eager(x), rtol=0, atol=0)
        if i == 5:
            assert torchnative.stats()["replays"] >= 2  # the steady calls replayed the constant


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_dua_as_its_library_runs_it_replays_both_calls_of_a_step(delegate):
    """DUA's step: the BatchNorms alone in train mode with a new momentum for a call that updates
    their statistics, then the whole model in eval mode for the prediction. Each mode is a guard
    of its own (the old code took every flip for a changed attribute: no call replayed)."""
    torch.manual_seed(0)
    model = Net(torch.nn.BatchNorm2d, train=None)  # the step sets the modes
    eager, accelerated = copy.deepcopy(model), torchnative.accelerate(copy.deepcopy(model), delegates=[delegate])
    tol = dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-5, atol=1e-5)

    def step(m, x, i):
        m.eval()
        for bn in (m.bn, m.bn2):
            bn.train()
            bn.momentum = max(0.1 * 0.94 ** i, 0.005)
        with torch.no_grad():
            m(x)
            m.eval()
            return m(x)

    torchnative.reset_stats()
    clear_caches()
    for i in range(CALLS):
        x = _x(i)
        assert_same(step(accelerated, x, i), step(eager, x, i), **tol)
        assert_same(dict(accelerated.state_dict()), dict(eager.state_dict()), **tol)
    assert torchnative.stats()["replays"] >= CALLS, torchnative.stats()
    if delegate == "ort":  # the train-mode BatchNorms with the momentum as an input (decomposed) on ONNX Runtime
        trained = [p for p in programs() if any(type(n.meta["val"]) is float for n in p.graph.placeholders())
                   and any(d != "eager" for d, _ in p.partitions)]
        assert trained and all([d for d, _ in p.partitions] == ["ort"] for p in trained), \
            [(p.partitions, p.declined) for p in trained]
        assert not torchnative.stats()["fallbacks"]


def test_an_eval_batch_norm_does_not_read_the_momentum_set_every_call():
    """Between DUA's updates the model predicts in eval mode, where a BatchNorm's momentum is not
    read: recorded as 0, it is not a float input, and every BatchNorm stays in the ONNX Runtime
    partition (the old code made the momentum an input ONNX cannot take: each BatchNorm on eager)."""
    torch.manual_seed(0)
    model = Net(torch.nn.BatchNorm2d, train=None).eval()
    eager, accelerated = copy.deepcopy(model), torchnative.accelerate(copy.deepcopy(model), delegates=["ort"])
    clear_caches()
    for i in range(6):
        for m in (eager, accelerated):
            m.bn.momentum = m.bn2.momentum = 0.1 * 0.9 ** i
        x = _x(i)
        with torch.no_grad():
            assert_same(accelerated(x), eager(x), rtol=1e-5, atol=1e-5)
    torchnative.wait_for_compiles()
    built = [p for p in programs() if any(d == "ort" for d, _ in p.partitions)]
    assert built and all(not any(type(n.meta["val"]) is float for n in p.graph.placeholders()) for p in built)
    assert all(len(p.partitions) == 1 for p in built), [p.partitions for p in built]


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_a_followed_float_in_a_call_autograd_records(delegate):
    """A temperature set between training steps: a graph autograd records reads the float. Such
    calls are recorded every time (a replay's backward would hold the float it was traced with:
    gradients 0.3-0.5 off on the calls that replayed, found here); gradients are eager's."""
    torch.manual_seed(0)
    model = Scaled(lambda m, h: (h / m.t).tanh().sum())
    eager, accelerated = copy.deepcopy(model), torchnative.accelerate(copy.deepcopy(model), delegates=[delegate])
    tol = dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-5, atol=1e-5)
    for i in range(CALLS):
        x = _x(i)[:, 0, 0]
        for m in (eager, accelerated):
            _temperature(m, i)
            m.zero_grad()
            m(x).backward()
        for p, q in zip(eager.parameters(), accelerated.parameters()):
            assert_same(q.grad, p.grad, **tol)
    assert torchnative.stats()["replay_ineligible"]["a graph autograd records reads a Python float that changes "
                                                    "between calls"] > 0

"""Test-time adaptation written the way public TTA libraries write it (issue 42): a BatchNorm
momentum passed by keyword (`add_(batch_mean, alpha=m)`, DUA), a mean teacher updated through
`.data =` inside the step (and inside an accelerated forward), `model.eval()` at the top of a
forward (tests/test_replay.py). Each against eager, on `eager` (exact) and `ort`."""
from __future__ import annotations

import copy

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative.cache.program_cache import clear_caches, programs

DELEGATES = ["eager", "ort"]


def _tol(delegate: str) -> dict:
    return dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-4, atol=1e-5)


class DUA(torch.nn.Module):
    """DUA's update as its library writes it: the running statistics moved by a momentum that
    decays every call, passed as `alpha=`; then the normalized features."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.conv, self.bn = torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8)
        self.calls = 0

    def forward(self, x):
        m = max(0.1 * 0.94 ** self.calls, 0.005)
        self.calls += 1
        feats = self.conv(x)
        self.bn.running_mean.mul_(1 - m).add_(feats.mean((0, 2, 3)), alpha=m)
        self.bn.running_var.mul_(1 - m).add_(feats.var((0, 2, 3)), alpha=m)
        return torch.nn.functional.batch_norm(feats, self.bn.running_mean, self.bn.running_var, self.bn.weight,
                                              self.bn.bias, False).relu()


@pytest.mark.parametrize("delegate", DELEGATES)
def test_a_keyword_momentum_that_decays_is_a_scalar_input_not_a_graph_per_call(delegate):
    eager, accelerated = DUA(), torchnative.accelerate(DUA(), delegates=[delegate])
    clear_caches()
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(i % 3))
            assert_same(accelerated(x), eager(x), **_tol(delegate))
    assert_same(accelerated.bn.running_mean, eager.bn.running_mean, **_tol(delegate))
    assert_same(accelerated.bn.running_var, eager.bn.running_var, **_tol(delegate))
    # the first call's graph (the momentum a constant) and the one with it as an input
    assert len({p.captured.key for p in programs()}) <= 2
    compiled = [p for p in programs() if any(type(n.meta["val"]) is float for n in p.graph.placeholders())]
    assert compiled, "the momentum never became an input"


class _Tracked(torch.nn.Module):
    """DUA's update on a linear layer's features, in float64 (ONNX Runtime has no float64 Conv)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.calls = torch.nn.Linear(8, 8).double(), 0
        self.register_buffer("mean", torch.zeros(8, dtype=torch.float64))

    def forward(self, x):
        m = max(0.1 * 0.94 ** self.calls, 0.005)
        self.calls += 1
        y = self.lin(x)
        self.mean.mul_(1 - m).add_(y.mean(0), alpha=m)
        return (y - self.mean).relu()


@pytest.mark.parametrize("make,shape,dtype", [(DUA, (2, 3, 8, 8), torch.float32), (_Tracked, (4, 8), torch.float64)])
def test_a_decaying_momentum_runs_on_ort_as_an_input_of_its_partition(make, shape, dtype):
    """The ops that read the momentum run on ONNX Runtime, the momentum a 0-d tensor input cast to
    the dtype they compute in (passes/scalars.py), not on eager around every BatchNorm (RT-DETR:
    115 partitions)."""
    eager, accelerated = make(), torchnative.accelerate(make(), delegates=["ort"])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad():
        for i in range(12):
            x = torch.randn(*shape, generator=torch.Generator().manual_seed(i % 3), dtype=dtype)
            assert_same(accelerated(x), eager(x), **_tol("ort"))
    for mine, theirs in zip(accelerated.buffers(), eager.buffers()):
        assert_same(mine, theirs, **_tol("ort"))
    compiled = [p for p in programs() if any(type(n.meta["val"]) is float for n in p.graph.placeholders())
                and any(d == "ort" for d, _ in p.partitions)]
    assert compiled and all(p.partitions == (("ort", p.partitions[0][1]),) for p in compiled), \
        [(p.partitions, p.declined) for p in programs()]
    assert not torchnative.stats()["fallbacks"]


class _Slope(torch.nn.Module):
    """A float that changes every call where ONNX takes a constant (leaky_relu's slope)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin, self.calls = torch.nn.Linear(8, 8), 0

    def forward(self, x):
        self.calls += 1
        y = self.lin(x) * (1 + 0.1 * self.calls)
        return torch.nn.functional.leaky_relu(y, 0.01 * self.calls).sum(-1)


def test_a_changing_float_where_onnx_takes_a_constant_runs_on_eager_and_says_why():
    eager, accelerated = _Slope(), torchnative.accelerate(_Slope(), delegates=["ort"])
    clear_caches()
    with torch.no_grad():
        for i in range(8):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
            assert_same(accelerated(x), eager(x), **_tol("ort"))
    compiled = [p for p in programs() if any(type(n.meta["val"]) is float for n in p.graph.placeholders())
                and any(d == "ort" for d, _ in p.partitions)]
    assert compiled, [(p.partitions, p.declined) for p in programs()]
    for p in compiled:
        assert ("eager", 1) in p.partitions and any(d == "ort" for d, _ in p.partitions), p.partitions
        assert any("leaky_relu" in op and "ONNX takes a constant" in why for op, _, why in p.declined), p.declined


def _mean_teacher():
    torch.manual_seed(0)
    student = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    teacher = copy.deepcopy(student)
    return student, teacher, torch.optim.SGD(student.parameters(), lr=0.1)


def _step(state, x, a: float = 0.99):
    """One mean-teacher step: the student trained to the teacher's predictions, then the teacher
    moved towards the student through `.data =`, as the library writes it."""
    student, teacher, opt = state
    with torch.no_grad():
        target = teacher(x).softmax(-1)
    loss = -(target * student(x).log_softmax(-1)).sum(-1).mean()
    opt.zero_grad()
    loss.backward()
    opt.step()
    for t_p, s_p in zip(teacher.parameters(), student.parameters()):
        t_p.data = a * t_p.data + (1 - a) * s_p.data
    return loss.detach()


@pytest.mark.parametrize("delegate", DELEGATES)
def test_a_mean_teacher_updated_through_data_inside_a_captured_step_matches_eager(delegate):
    eager, captured = _mean_teacher(), _mean_teacher()
    torchnative.reset_stats()
    for i in range(10):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(i))
        expected = _step(eager, x)
        with torchnative.capture([delegate]):
            got = _step(captured, x)
        assert_same(got, expected, **_tol(delegate))
    for mine, theirs in zip(captured[1].parameters(), eager[1].parameters()):
        assert_same(mine.detach(), theirs.detach(), **_tol(delegate))
    # the build's check compares each partition with the values eager had where it read them, not
    # after the step wrote them in place (it declined a partition of this step 0.667 "off")
    assert not [f for f in torchnative.stats()["fallbacks"] if "verify" in f]


class _Teaching(torch.nn.Module):
    """A method whose forward updates its teacher (an EMA of the model) before predicting with it."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        self.teacher = copy.deepcopy(self.model)

    def forward(self, x, a: float = 0.9):
        with torch.no_grad():
            self.model[0].weight.add_(x.mean() * 0.01)  # the model adapts a little every call
            for t_p, s_p in zip(self.teacher.parameters(), self.model.parameters()):
                t_p.data = a * t_p.data + (1 - a) * s_p.data
        return self.teacher(x)


@pytest.mark.parametrize("delegate", DELEGATES)
def test_a_teacher_updated_through_data_inside_an_accelerated_forward_matches_eager(delegate):
    eager, accelerated = _Teaching(), torchnative.accelerate(_Teaching(), delegates=[delegate])
    with torch.no_grad():
        for i in range(8):
            x = torch.randn(3, 8, generator=torch.Generator().manual_seed(i))
            assert_same(accelerated(x), eager(x), **_tol(delegate))
    for mine, theirs in zip(accelerated.teacher.parameters(), eager.teacher.parameters()):
        assert_same(mine, theirs, **_tol(delegate))

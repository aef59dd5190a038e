"""Data Python reads of weights alone (`use_bias = not torch.isnan(self.bias).any()` in every step
of a TTT-style scan) are computed apart from the weights, without cutting the graph
(recording/recorder.WeightRead), and computed again by a replay before its programs run
(replay/trace.run): a weight that changes the read records again, with eager's branch."""
import pytest
import torch

import torchnative
from tests.conftest import assert_same

DELEGATES = [["eager"], ["ort"]]


class Scan(torch.nn.Module):
    """Per chunk, a fast weight takes a step and a data read of a parameter picks a branch; the
    chunk's output is written into a buffer made before the scan."""

    def __init__(self, dim: int = 8, chunk: int = 4):
        super().__init__()
        self.k = torch.nn.Linear(dim, dim)
        self.bias = torch.nn.Parameter(torch.zeros(dim))
        self.w0 = torch.nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
        self.chunk = chunk

    def forward(self, x):
        b, n, d = x.shape
        k = self.k(x)
        w = self.w0
        out = torch.empty(b, n, d)
        for i in range(0, n, self.chunk):
            use_bias = not torch.isnan(self.bias).any()
            kc = k[:, i:i + self.chunk]
            w = w - 0.1 * (kc.transpose(1, 2) @ (kc @ w - kc)).mean(0)
            y = kc @ w
            out[:, i:i + self.chunk] = y + self.bias if use_bias else y * 2
        return out


def _pair():
    torch.manual_seed(0)
    eager, accel = Scan(), Scan()
    accel.load_state_dict(eager.state_dict())
    return eager, accel


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_a_read_of_a_weight_in_every_step_makes_one_graph_that_replays(delegates):
    eager, accel = _pair()
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    seq = torch.randn(2, 16 * 8, 8)
    torchnative.reset_stats()
    with torch.no_grad():
        for i in range(8):
            x = seq[:, i * 16:(i + 1) * 16]
            assert_same(accel(x), eager(x), rtol=1e-5, atol=1e-6)
    s = torchnative.stats()
    assert s["graphs_built"] == 1 and s["replays"] >= 6, s
    assert not s["syncs"], s["syncs"]  # no read cut the graph


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
@pytest.mark.parametrize("how", ["in place", ".data =", "back"])
def test_a_weight_that_changes_the_read_takes_eager_s_branch(delegates, how):
    eager, accel = _pair()
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    x = torch.randn(2, 16, 8)
    with torch.no_grad():
        for _ in range(4):  # replaying
            assert_same(accel(x), eager(x), rtol=1e-5, atol=1e-6)
        for m in (eager, accel):
            if how == ".data =":
                m.bias.data = torch.full((8,), float("nan"))
            else:
                m.bias[3] = float("nan")
                if how == "back":
                    m.bias[3] = 0.0  # the version moved, the value did not
        replays = torchnative.stats()["replays"]
        for _ in range(3):
            assert_same(accel(x), eager(x), rtol=1e-5, atol=1e-6)
    if how == "back":
        assert torchnative.stats()["replays"] > replays  # the read came out the same: replayed


class WritesThenReads(torch.nn.Module):
    """A step writes a parameter (a TTA update), a cut runs the write, then Python reads data of
    the parameter: the read is of the written value, which a replay (writes at its end) cannot
    compute before its programs."""

    def __init__(self):
        super().__init__()
        self.scale = torch.nn.Parameter(torch.ones(4))

    def forward(self, x):
        with torch.no_grad():
            self.scale.mul_(0.5)
        y = x * self.scale
        if not torch.isfinite(y).all():  # a cut after the write, read the same every call
            raise ValueError("not finite")
        return y * 2 if bool((self.scale < 0.2).any()) else y


def test_a_read_of_a_weight_an_earlier_graph_wrote_stays_eager_s():
    torch.manual_seed(0)
    eager, accel = WritesThenReads(), WritesThenReads()
    torchnative.accelerate(accel, delegates=["eager"], compile_after=1, background=False)
    x = torch.randn(3, 4)
    for _ in range(6):  # scale 0.5, 0.25, 0.125 (the branch turns), ...
        assert_same(accel(x), eager(x))
        assert_same(accel.scale, eager.scale)

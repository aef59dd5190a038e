"""Arguments keyed by what they are, not where they sit: a slice of one sequence at each call's
offset records one graph and replays (recording/recorder.Recorder.new_input, replay/guard.guard_key),
while whatever depends on the offset — a view of the argument returned, an offset Python reads,
an op taking a storage offset, a write into the argument — stays eager's."""
import pytest
import torch

import torchnative
from tests.conftest import assert_same

DELEGATES = [["eager"], ["ort"]]


class Chunk(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.tanh(self.lin(x)).cumsum(1)


def _pair(cls):
    torch.manual_seed(0)
    eager = cls()
    accel = cls()
    accel.load_state_dict(eager.state_dict())
    return eager, accel


def _chunks(seq: torch.Tensor, width: int) -> list[torch.Tensor]:
    return [seq[:, i:i + width] for i in range(0, seq.shape[1] - width + 1, width)]


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_slices_of_a_sequence_at_new_offsets_make_one_graph_and_replay(delegates):
    eager, accel = _pair(Chunk)
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    seq = torch.randn(2, 8 * 12, 8)
    torchnative.reset_stats()
    with torch.no_grad():
        for x in _chunks(seq, 8):  # each call at an offset never seen
            assert_same(accel(x), eager(x), rtol=1e-5, atol=1e-6)
    s = torchnative.stats()
    assert s["graphs_built"] <= 2 and s["replays"] >= 9, s


class ViewsOut(torch.nn.Module):
    """Returns views of its argument."""
    def forward(self, x):
        return x[:, 1:], x.t(), x.sum()


class OffsetRead(torch.nn.Module):
    """Makes a value of the offset Python reads of a view of its argument."""
    def forward(self, x):
        head = x[:, 1:]
        return head.sum() + head.storage_offset()


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_views_of_an_argument_are_eager_s(delegates):
    eager, accel = ViewsOut(), ViewsOut()
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    seq = torch.randn(4, 40)
    torchnative.reset_stats()
    with torch.no_grad():
        for i in [0, 4, 4, 4, 8, 4, 12, 12, 12, 0]:  # a view source replays only at its offset
            x = seq[:, i:i + 4]
            got, want = accel(x), eager(x)
            assert_same(got, want)
            for g, w in zip(got[:2], want[:2]):
                assert g.storage_offset() == w.storage_offset()
                assert g.untyped_storage().data_ptr() == seq.untyped_storage().data_ptr()
    assert torchnative.stats()["replays"] >= 2, torchnative.stats()


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_an_offset_python_reads_is_eager_s(delegates):
    eager, accel = OffsetRead(), OffsetRead()
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    seq = torch.randn(4, 40)
    with torch.no_grad():
        for i in [0, 4, 8, 4, 12, 16, 0, 20]:
            assert_same(accel(seq[:, i:i + 4]), eager(seq[:, i:i + 4]))


class Strided(torch.nn.Module):
    """An op taking a storage offset, counted from the argument's place in its storage."""
    def forward(self, x):
        y = x * 2
        return y.sum(1) + x.as_strided((2, 3), (x.stride(0), 1), x.storage_offset() + 1).sum()


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
@pytest.mark.parametrize("first", [0, 6], ids=["at-start-first", "moved-first"])
def test_an_op_taking_a_storage_offset_reads_where_eager_reads(first, delegates):
    eager, accel = Strided(), Strided()
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    seq = torch.randn(2, 30)
    with torch.no_grad():
        for i in [first, first, 0, 6, 12, 0, 0, 18, 18]:
            x = seq[:, i:i + 6]
            assert_same(accel(x), eager(x))


class WriteInto(torch.nn.Module):
    """Writes into its argument (a scan's output buffer given by the caller)."""
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        x.mul_(0.5).add_(self.lin(x))
        x[:, 0] = 1.0
        return x.sum()


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_writes_into_an_argument_land_where_eager_writes(delegates):
    eager, accel = _pair(WriteInto)
    torchnative.accelerate(accel, delegates=delegates, compile_after=1, background=False)
    mine, theirs = torch.randn(3, 8 * 4), None
    theirs = mine.clone()
    # a write's offset is part of its graph (the scatter into the whole tensor): on ort a compile each
    offsets = [0, 4, 8, 4, 12, 16, 12, 28, 0] if delegates == ["eager"] else [0, 4, 0, 4]
    with torch.no_grad():
        for i in offsets:
            assert_same(accel(mine[:, i:i + 4]), eager(theirs[:, i:i + 4]), rtol=1e-5, atol=1e-6)
            assert_same(mine, theirs, rtol=1e-5, atol=1e-6)


def test_a_scan_over_chunks_of_a_sequence_replays_under_capture():
    """A fast-weight scan as a library writes it: chunks sliced from one sequence, a state
    carried from call to call."""
    eager, accel = _pair(Chunk)
    torchnative.accelerate(accel, compile_after=1, background=False)
    seq = torch.randn(1, 8 * 16, 8)
    state_e = state_a = torch.zeros(1, 8, 8)
    torchnative.reset_stats()
    with torch.no_grad():
        for x in _chunks(seq, 8):
            state_e = state_e + eager(x)
            state_a = state_a + accel(x)
            assert_same(state_a, state_e, rtol=1e-5, atol=1e-5)
    assert torchnative.stats()["replays"] >= 13, torchnative.stats()

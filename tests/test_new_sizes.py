"""Calls at sizes never seen replay (replay/new_sizes.py): a decode step over a longer cache, a
prompt of a new length. A size between the least and greatest sizes that recorded one trace
replays it; a size beyond them records (a branch on a size is seen before it is crossed); a
recording inside a span that made another trace ends the span; results stay eager's."""
from __future__ import annotations

import copy

import pytest
import torch

import torchnative
from torchnative import models, events
from torchnative.cache import program_cache
from torchnative.cache.program_cache import clear_caches
from torchnative.replay.new_sizes import Span
from torchnative.replay.replayer import Replayer
from torchnative.replay.worth import Worth
from torchnative.sizes import Flat


class Branchy(torch.nn.Module):
    """A branch on a size: rows past `at` are doubled; with `odd`, odd sizes are shifted instead."""

    def __init__(self, at: int = 10**6, odd: bool = False):
        super().__init__()
        self.linear, self.at, self.odd = torch.nn.Linear(8, 8), at, odd

    def forward(self, x):
        y = self.linear(x)
        if x.shape[0] > self.at:
            y = y * 2
        if self.odd and x.shape[0] % 2:
            y = y + 1
        return torch.tanh(y)


def _calls(model, eager, sizes):
    """Each size's output equal to eager's; the new-size replays each call made."""
    made = []
    for n in sizes:
        x = torch.randn(n, 8)
        before = torchnative.stats()["new_size_replays"]
        with torch.no_grad():
            torch.testing.assert_close(model(x), eager(x), rtol=1e-5, atol=1e-6)
        made.append(torchnative.stats()["new_size_replays"] - before)
    return made


@pytest.mark.parametrize("delegates", [["eager"], ["ort"]])
def test_a_size_between_recorded_sizes_replays_and_one_beyond_records(delegates):
    eager = Branchy(at=60)
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=delegates)
    clear_caches()
    torchnative.reset_stats()
    # 10, 20 fit the template, 30 confirms it: its program runs 30, 40, 50, whose traces make the span
    made = _calls(model, eager, [10, 20, 30, 40, 50, 35, 45])
    assert made == [0, 0, 0, 0, 0, 1, 1], made
    # past the span: recorded, the branch taken as eager takes it; 55 widens the span to 30..55
    made = _calls(model, eager, [70, 55, 53, 65, 52])
    assert made == [0, 0, 1, 0, 1], made


def test_a_recording_inside_a_span_that_made_another_trace_ends_it():
    eager = Branchy(odd=True)
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=["eager"])
    clear_caches()
    torchnative.reset_stats()
    # even sizes make one trace (its program the template's from 30 on); 35 (odd), inside the
    # sizes 30..50 recorded with it, another
    made = _calls(model, eager, [10, 20, 30, 50, 35, 40, 60, 44, 46, 52])
    assert sum(made) == 0, made  # the span is over: every size never seen records


def test_replay_new_sizes_off_records_every_size_never_seen():
    eager = Branchy()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=["eager"], replay_new_sizes=False)
    clear_caches()
    torchnative.reset_stats()
    assert sum(_calls(model, eager, [10, 20, 30, 40, 50, 35, 45])) == 0
    assert torchnative.stats()["replays"] == 0


@pytest.mark.parametrize("delegates", [["eager"], ["ort"]])
def test_decode_steps_at_cache_lengths_never_seen_replay_with_eagers_tokens(delegates):
    model = models.build("gpt2")
    accel = torchnative.accelerate(copy.deepcopy(model), delegates=delegates)
    clear_caches()
    torchnative.reset_stats()
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    replayed = []
    for n in [12, 40, 24, 30]:  # each a new prompt length; 24 and 30's decode lengths lie inside 13..49
        ids = torch.randint(0, 999, (1, n), generator=torch.Generator().manual_seed(n))
        before = torchnative.stats()["new_size_replays"]
        with torch.no_grad():
            assert torch.equal(accel.generate(ids, **kwargs), model.generate(ids, **kwargs))
        replayed.append(torchnative.stats()["new_size_replays"] - before)
    assert replayed[:2] == [0, 0] and min(replayed[2:]) >= 5, replayed


class Rows(torch.nn.Module):
    """Outputs that are views Python took of a graph's value: a linear layer over (b, n, 8) runs
    on the rows flattened and views them back, and the last position is a slice of that."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.linear(x)
        return y, y[:, -1]


@pytest.mark.parametrize("delegates", [["eager"], ["ort"]])
def test_views_of_outputs_replay_at_new_sizes_with_the_sizes_of_the_call(delegates):
    """The views' shapes, strides and offsets follow the call's sizes by rules fitted as the
    sizes' own: each size never seen between recorded ones replays, each view as eager's."""
    eager = Rows()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=delegates)
    clear_caches()
    torchnative.reset_stats()
    made = []
    # 10, 20 fit the template, 30 confirms it; its program's traces at 30, 40, 50 make the span
    for n in [10, 20, 30, 40, 50, 35, 45, 42, 12]:
        x = torch.randn(3, n, 8)
        before = torchnative.stats()["new_size_replays"]
        with torch.no_grad():
            got, want = model(x), eager(x)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
            assert (g.shape, g.stride()) == (w.shape, w.stride())
            assert g._base is not None  # a view, as eager's is
        made.append(torchnative.stats()["new_size_replays"] - before)
    assert made == [0, 0, 0, 0, 0, 1, 1, 1, 0], made  # 12: below the span, recorded


def test_a_prompt_of_a_new_length_replays_with_eagers_logits():
    """GPT-2 at a new batch size and length every call (no cache): the logits are a view of the
    LM head's product, and sizes between recorded ones replay."""
    model = models.build("gpt2")
    model.config.use_cache = False
    accel = torchnative.accelerate(copy.deepcopy(model), delegates=["eager"])
    clear_caches()
    torchnative.reset_stats()
    gen = torch.Generator().manual_seed(0)
    for b, n in [(2, 10), (2, 40), (2, 25), (2, 33), (2, 17), (2, 29), (2, 21), (2, 35), (2, 19), (2, 27), (3, 30)]:
        ids = torch.randint(0, 999, (b, n), generator=gen)
        with torch.no_grad():
            got, want = accel(ids).logits, model(ids).logits
        assert torch.equal(got, want) and got.stride() == want.stride()
    # 29, 21, 19, 27: inside 17..35, each recorded with the template's program
    assert torchnative.stats()["new_size_replays"] == 4, torchnative.stats()


def test_a_replay_of_an_eager_program_records_once_its_compile_is_built(monkeypatch):
    """A trace that ran a graph's eager program while its compile had not repaid (the cost rule)
    is let go once the delegates' program is built: the next call at its sizes records and runs
    the built one, whichever size's replay repaid the compile."""
    monkeypatch.setattr(program_cache, "REPAY", 2e-3)
    # the cost rule counts runs here, not seconds: a compile's estimate is measured in-process, and
    # one slow compile on a loaded machine made these ~0.1 ms runs never repay the next (CI saw it)
    ran = program_cache.ProgramCache.ran
    monkeypatch.setattr(program_cache.ProgramCache, "ran", lambda self, run_key, seconds: ran(self, run_key, 1.0))
    monkeypatch.setattr(program_cache.ProgramCache, "_estimate", lambda self, delegates, n_ops: 6 / program_cache.REPAY)
    monkeypatch.setattr(Worth, "eager_next", lambda self, structure: False)  # every call recorded or replayed
    eager = Branchy()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=["ort"], compile_after=None, background=False)
    clear_caches()
    torchnative.reset_stats()
    runs = []
    events._listeners.append(runs.append)
    try:
        _calls(model, eager, [10, 20, 30, 40, 50] + [35, 45, 30, 40] * 10)
        runs.clear()
        _calls(model, eager, [37, 43, 30])
    finally:
        events._listeners.remove(runs.append)
    ran = [e for e in runs if isinstance(e, events.GraphRun)]
    assert ran and all(any(d == "ort" for d, _ in e.partitions) for e in ran), [e.partitions for e in ran]
    assert any(e.replayed for e in ran)


def test_a_call_autograd_records_is_not_replayed_at_sizes_never_seen():
    """Its programs' backward is traced at the sizes it was recorded at: every size never seen
    records, and the gradients are eager's. (Today each size's graph under autograd has a program
    of its own, so no two sizes make one trace; the rule in new_sizes.Spans.learn keeps it so if a
    template's program ran under autograd.)"""
    eager = Branchy()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=["eager"])
    clear_caches()
    torchnative.reset_stats()
    for n in [10, 20, 30, 40, 50, 35, 45, 35]:
        x = torch.randn(n, 8)
        for m in (model, eager):
            m.zero_grad()
            m(x).square().sum().backward()
        for a, b in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(a.grad, b.grad, rtol=1e-5, atol=1e-6)
    assert torchnative.stats()["new_size_replays"] == 0


def test_views_that_break_their_rules_start_the_span_over():
    """A view's integers fitted on two recordings and confirmed by a third give a size between
    them its view; a recording whose view follows no such rule (fitted on a coincidence) starts
    the span over, so no size replays a view of a rule that failed."""
    def flat(n: int) -> Flat:
        return Flat([("T", torch.float32, 1, (0,)), 0], [n], [(0, "input", 0, "shape", 0)])

    span = Span(None, flat(10), views=[10, 80])
    span.widen(flat(20), [20, 160])
    span.widen(flat(30), [30, 240])
    assert span.recorded == 3 and span.covers(flat(25))
    assert [r.value(span.values(flat(25))) for r in span.view_rules] == [25, 200]
    span.widen(flat(40), [40, 999])
    assert span.recorded == 1 and not span.covers(flat(25))


def test_a_decode_step_at_new_lengths_replays_one_trace_object(monkeypatch):
    """A decode step's views are the same at every length (the logits of one token): its replays
    at new lengths run one trace, whose outputs' builder is made once."""
    model = models.build("gpt2")
    accel = torchnative.accelerate(copy.deepcopy(model), delegates=["eager"])
    clear_caches()
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)
    replayed = []
    replay = Replayer.replay

    def spy(self, key, found, *args, **kw):
        if found[1] is not None:  # a span's
            replayed.append(found[0])
        return replay(self, key, found, *args, **kw)
    monkeypatch.setattr(Replayer, "replay", spy)
    for n in [12, 40, 24]:
        ids = torch.randint(0, 999, (1, n), generator=torch.Generator().manual_seed(n))
        with torch.no_grad():
            assert torch.equal(accel.generate(ids, **kwargs), model.generate(ids, **kwargs))
    assert len(replayed) >= 5 and len({id(t) for t in replayed}) == 1, len({id(t) for t in replayed})

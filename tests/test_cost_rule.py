"""The cost rule (cache/program_cache.py, `compile_after=None`, the default outside the tests): a
graph compiles once its runs on eager took REPAY of its compile's estimated seconds; until then it
runs (and replays) on eager's program, and `explain()` says why. Results are eager's throughout."""
import copy
import time
import types

import pytest
import torch

import torchnative
from torchnative.cache import program_cache
from torchnative.cache.program_cache import CACHE, programs
from torchnative.replay import worth


class Mlp(torch.nn.Module):
    def __init__(self, width: int):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(width, width), torch.nn.GELU(), torch.nn.Linear(width, width))

    def forward(self, x):
        return self.body(x).tanh()


def _compiled() -> list:
    return [p for p in programs() if any(d != "eager" for d, _ in p.partitions)]


@pytest.fixture(autouse=True)
def fresh():
    CACHE.clear()
    torchnative.reset_stats()
    yield
    CACHE.clear()


def test_the_reason_is_in_explain(monkeypatch):
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1.0)
    x = torch.randn(2, 8)
    model = Mlp(8)
    with torch.no_grad(), torchnative.capture(["ort"], compile_after=None):
        for _ in range(3):
            model(x).sum().item()
    with torch.no_grad():
        graphs = []
        stop = torchnative.events.listen(lambda e: graphs.append(e) if isinstance(e, torchnative.events.GraphRun) else None)
        try:
            with torchnative.capture(["ort"], compile_after=None):
                model(x).sum().item()
        finally:
            stop()
    assert any("cost rule" in g.not_compiled and "estimated" in g.not_compiled for g in graphs), \
        [g.not_compiled for g in graphs]


def test_a_graph_whose_eager_runs_repay_its_compile_compiles_and_a_replay_moves_to_it(monkeypatch):
    """Replayed on eager's program while its time adds up; once it repays, the next call records
    again and compiles, and later calls replay the compiled program — at once, though recording is
    judged the slower (the calls before the compile run as eager in stretches)."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1e-4)  # a compile estimated at ~0.2 s
    monkeypatch.setattr(worth, "_MARGIN", 0.0)
    model, x = Mlp(256), torch.randn(512, 256)
    with torch.no_grad():
        expected = model(x)
        torchnative.accelerate(model, delegates=["ort"], compile_after=None)
        for _ in range(400):
            got = model(x)
            if _compiled():
                break
        assert _compiled(), CACHE.eager_seconds.values()
        # the calls after the compile record it twice, then replay it, with no stretch of calls run
        # as eager between (recorded calls that learn a compiled trace are not weighed)
        before = torchnative.stats()
        for _ in range(5):
            torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    after = torchnative.stats()
    assert after["replays"] >= before["replays"] + 3 and after["eager_calls"] == before["eager_calls"], after
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_an_explicit_count_compiles_whatever_the_cost():
    model, x = Mlp(8), torch.randn(2, 8)
    with torch.no_grad():
        torchnative.accelerate(model, delegates=["ort"], compile_after=2)
        for _ in range(3):
            model(x)
    assert _compiled()


def test_each_new_model_of_the_same_graphs_repays_its_own_compile(monkeypatch):
    """A test suite builds a new model per test and calls it a few times: once one model's graph
    compiled, a new model (new weights, so a program of its own) runs on eager until it repays too,
    not one compile per model."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1e-4)
    x = torch.randn(512, 256)
    first = torchnative.accelerate(Mlp(256), delegates=["ort"], compile_after=None)
    with torch.no_grad():
        for _ in range(400):
            first(x)
            if _compiled():
                break
        assert len(_compiled()) == 1
        for _ in range(4):
            model = Mlp(256)
            expected = model(x)
            torchnative.accelerate(model, delegates=["ort"], compile_after=None)
            for _ in range(3):
                torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    assert len(_compiled()) == 1


class Decaying(torch.nn.Module):
    """DUA's pattern: statistics moved by a momentum the method decays before every call (a Python
    float that enters an op by keyword), held by a schedule object that is no module (a module's
    float attribute is followed, replay/floats.py): no call can replay."""

    def __init__(self, width: int):
        super().__init__()
        self.body, self.schedule = Mlp(width), types.SimpleNamespace(momentum=0.1)
        self.register_buffer("mean", torch.zeros(width))

    @property
    def momentum(self) -> float:
        return self.schedule.momentum

    def forward(self, x):
        self.mean.mul_(1 - self.momentum).add_(x.mean(0), alpha=self.momentum)
        return self.body(x - self.mean)


def _step(model: Decaying, x: torch.Tensor) -> torch.Tensor:
    model.schedule.momentum = max(model.momentum * 0.94, 0.005)
    return model(x)


@pytest.mark.parametrize("delegates", [["eager"], ["ort"]])
def test_calls_that_cannot_replay_and_record_slower_than_eager_run_as_eager(delegates):
    """Recording a tiny graph costs more than running it: after the second call (timed recorded)
    and the third (timed on eager), stretches of calls run as eager, each followed by one recorded
    call that looks again; outputs and state are eager's throughout."""
    torch.manual_seed(0)
    model, xs = Decaying(16), [torch.randn(4, 16) for _ in range(3)]
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=delegates, compile_after=None)
    with torch.no_grad(), torchnative.profile() as profile:
        for i in range(40):
            expected, got = _step(reference, xs[i % 3]), _step(model, xs[i % 3])
            assert torch.equal(got, expected) and torch.equal(model.mean, reference.mean), i
    stats = torchnative.stats()
    assert stats["replays"] == 0 and 30 <= stats["eager_calls"] <= 37, stats
    assert stats["replay_ineligible"], stats
    assert profile.data["counters"]["eager_calls"] == stats["eager_calls"]
    assert any(why.startswith("ran as eager: recording or replaying it took") for why in profile.data["replay_ineligible"])


class Memory:
    """A cache object that grows every call (a decode step's): its tensors' sizes are not the call's structure."""

    def __init__(self, width: int):
        self.keys = torch.zeros(0, width)


class DecayingOverMemory(Decaying):
    def forward(self, x, memory):
        memory.keys = torch.cat([memory.keys, x * self.momentum])
        return self.body(memory.keys.mean(0, keepdim=True))


def test_calls_over_a_growing_cache_are_weighed_as_one_structure():
    """Calls that cannot replay over a cache one step longer each call (new sizes of the tensors
    it holds, not of the arguments) are weighed together: recorded slower than eager, they run
    as eager, with eager's results and cache."""
    torch.manual_seed(0)
    model, xs = DecayingOverMemory(16), [torch.randn(4, 16) for _ in range(3)]
    reference = copy.deepcopy(model)
    mine, theirs = Memory(16), Memory(16)
    torchnative.accelerate(model, delegates=["eager"], compile_after=None)
    with torch.no_grad():
        for i in range(40):
            model.schedule.momentum = reference.schedule.momentum = max(model.momentum * 0.94, 0.005)
            assert torch.equal(model(xs[i % 3], mine), reference(xs[i % 3], theirs)), i
            assert torch.equal(mine.keys, theirs.keys), i
    stats = torchnative.stats()
    assert stats["replays"] == 0 and stats["eager_calls"] >= 20, stats


def test_calls_that_replay_a_compiled_program_are_never_run_as_eager(monkeypatch):
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1e-6)
    monkeypatch.setattr(program_cache, "_COMPILE_FLOOR", 1e-6)  # compiles at its first eager run
    model, x = Mlp(16), torch.randn(4, 16)
    torchnative.accelerate(model, delegates=["ort"], compile_after=None, background=False)
    with torch.no_grad():
        for _ in range(30):  # the first calls, recorded slower than eager, may run as eager until it compiles
            model(x)
        assert _compiled()
        before = torchnative.stats()
        for _ in range(20):
            model(x)
    after = torchnative.stats()
    assert after["eager_calls"] == before["eager_calls"] and after["replays"] == before["replays"] + 20, after


def test_calls_that_replay_eager_programs_slower_than_eager_run_as_eager(monkeypatch):
    """A replay whose programs all run on eager (the cost rule did not compile them) runs the
    recorded Core ATen graph through its GraphModule; slower than the forward's own ops, the calls
    run as eager, with eager's results, and still count toward the cost rule."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1.0)  # never repays here
    torch.manual_seed(0)
    model, x = Mlp(16), torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
        torchnative.accelerate(model, delegates=["ort"], compile_after=None)
        for _ in range(40):
            torch.testing.assert_close(model(x), expected)
    stats = torchnative.stats()
    assert not _compiled() and stats["not_compiled"]["cost"] >= 1, stats
    assert stats["replays"] >= 1 and stats["eager_calls"] >= 20, stats
    assert sum(s or 0.0 for s, _ in CACHE.eager_seconds.values()) > 0


def test_calls_run_as_eager_count_toward_the_cost_rule_and_a_compile_that_repays_still_happens(monkeypatch):
    """Each eager call adds what the recorded call's graph took on eager to the cost rule's sum;
    once it repays, the next call records and compiles, and later calls run the compiled program."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1e-6)
    monkeypatch.setattr(program_cache, "_COMPILE_FLOOR", 0.02)  # repays after ~4 ms of eager runs
    torch.manual_seed(0)
    model, x = Decaying(64), torch.randn(64, 64)
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], compile_after=None)
    added = []  # what each eager call added to the cost rule's sums
    with torch.no_grad():
        for _ in range(400):
            calls, spent = torchnative.stats()["eager_calls"], sum(s or 0.0 for s, _ in CACHE.eager_seconds.values())
            torch.testing.assert_close(_step(model, x), _step(reference, x), rtol=1e-5, atol=1e-6)
            if torchnative.stats()["eager_calls"] > calls:
                added.append(sum(s or 0.0 for s, _ in CACHE.eager_seconds.values()) - spent)
            if _compiled():
                break
    assert _compiled() and added and all(a > 0 for a in added), added
    for _ in range(5):
        torch.testing.assert_close(_step(model, x), _step(reference, x), rtol=1e-5, atol=1e-6)


def test_calls_at_a_new_size_every_time_run_as_eager_once_recording_them_costs_more(monkeypatch):
    """Traffic of another length every call (BERT at random lengths) records at each new size: the
    calls of one structure, whatever their sizes, are weighed together (sizes never seen recorded:
    replayed, they would not be weighed, tests/test_new_sizes.py)."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1.0)  # its compile never repays here
    torch.manual_seed(0)
    model = Decaying(16)
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], compile_after=None, replay_new_sizes=False)
    with torch.no_grad():
        for n in torch.randint(2, 64, (40,)).tolist():
            x = torch.randn(n, 16)
            # on eager, or on ort where a busy machine's timings made compiling worth it
            torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-6, msg=f"length {n}")
            torch.testing.assert_close(model.mean, reference.mean, rtol=1e-5, atol=1e-6)
    assert torchnative.stats()["eager_calls"] >= 20, torchnative.stats()  # half: 21-40 seen, by load


def test_calls_at_a_new_size_every_time_add_up_to_their_templates_compile(monkeypatch):
    """Each call at a length never seen (BERT at random lengths) is a graph of its own, seen once:
    its eager runs count toward the compile of the template its sizes follow (a fit of two sizes
    is enough), and the call after they repay records and compiles it. With a compile estimated at
    ~nothing, that is the fourth call (the first runs of a graph and of its template are not
    counted: one-time work); before, the seconds went to graphs never seen again."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 0.0)
    monkeypatch.setattr(program_cache, "_COMPILE_FLOOR", 1e-9)
    model = Mlp(64)
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], compile_after=None)
    with torch.no_grad():
        for i, n in enumerate([96, 300, 40, 138, 68, 261, 238]):
            x = torch.randn(n, 64)
            torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-5, msg=f"length {n}")
            if _compiled():
                break
    built = [k[0] for k, found in CACHE.programs.items() if found and k[2] != (program_cache.eager,)]
    assert i == 3 and built and all(isinstance(b, program_cache.Template) for b in built), (i, torchnative.stats())


@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_at_a_new_prompt_length_every_call_keeps_eagers_tokens(cache):
    """Chat traffic: every generate() a new prompt length, its KV cache an argument object that a
    call run as eager fills; the decode steps that follow are recorded or replayed from the cache's
    state, whatever ran before them."""
    from torchnative import models
    model = models.build("gpt2")
    reference = copy.deepcopy(model)
    kwargs = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    torchnative.accelerate(model, delegates=["ort"], compile_after=None)
    for length in torch.randint(4, 40, (10,), generator=torch.Generator().manual_seed(0)).tolist():
        ids = torch.randint(0, 999, (1, length), generator=torch.Generator().manual_seed(length))
        assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs)), length
    assert torchnative.stats()["eager_calls"] > 0, torchnative.stats()


def test_a_quantized_model_never_runs_a_call_as_eager():
    """Its outputs are the int8 program's: a call run as eager would return the float model's."""
    torch.manual_seed(0)
    model, x = Decaying(16), torch.randn(4, 16)
    torchnative.accelerate(model, delegates=["eager"], compile_after=None, quantize="int8")
    with torch.no_grad():
        for _ in range(12):
            _step(model, x)
    assert torchnative.stats()["eager_calls"] == 0 and torchnative.stats()["quantized"], torchnative.stats()


def test_replays_whose_backward_is_slower_than_eagers_run_as_eager(monkeypatch):
    """A training step (autograd records the forward): a replay's compiled forward may be faster than
    eager's while the backward it brings is slower, so a replay is weighed with its backward, timed
    alike on both sides. Here the replay's backward sleeps: the calls run as eager, in stretches,
    and every step's gradients and weights are eager's."""
    from torchnative.build import differentiable
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1e-6)
    monkeypatch.setattr(program_cache, "_COMPILE_FLOOR", 1e-6)  # compiles at its first eager run
    inner = differentiable._AsEager.backward

    def slow(ctx, *grads):
        time.sleep(0.01)
        return inner(ctx, *grads)
    monkeypatch.setattr(differentiable._AsEager, "backward", staticmethod(slow))
    torch.manual_seed(0)
    model, x = Mlp(16), torch.randn(4, 16)
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], compile_after=None, background=False)
    steps = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for i in range(40):
        for m, opt in zip((model, reference), steps):
            opt.zero_grad()
            m(x).square().mean().backward()
            opt.step()
        for p, q in zip(model.parameters(), reference.parameters()):
            torch.testing.assert_close(p, q, rtol=1e-4, atol=1e-5, msg=f"step {i}")
    stats = torchnative.stats()
    assert _compiled() and stats["replays"] >= 1 and stats["eager_calls"] >= 20, stats

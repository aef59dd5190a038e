"""The cost rule (cache/program_cache.py, `compile_after=None`, the default outside the tests): a
graph compiles once its runs on eager took REPAY of its compile's estimated seconds; until then it
runs (and replays) on eager's program, and `explain()` says why. Results are eager's throughout."""
import pytest
import torch

import torchnative
from torchnative.cache import program_cache
from torchnative.cache.program_cache import CACHE, programs


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


def test_a_graph_too_small_to_repay_its_compile_runs_and_replays_on_eager(monkeypatch):
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1.0)  # a compile estimated at seconds per op
    model, x = Mlp(8), torch.randn(2, 8)
    with torch.no_grad():
        expected = model(x)
        torchnative.accelerate(model, delegates=["ort"], compile_after=None)
        for _ in range(30):
            torch.testing.assert_close(model(x), expected)
    assert not _compiled()
    stats = torchnative.stats()
    assert stats["not_compiled"]["cost"] >= 1 and stats["replays"] >= 20


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
    again and compiles, and later calls replay the compiled program."""
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 1e-4)  # a compile estimated at ~0.2 s
    model, x = Mlp(256), torch.randn(512, 256)
    with torch.no_grad():
        expected = model(x)
        torchnative.accelerate(model, delegates=["ort"], compile_after=None)
        for _ in range(400):
            got = model(x)
            if _compiled():
                break
        assert _compiled(), CACHE.eager_seconds.values()
        for _ in range(3):
            torch.testing.assert_close(model(x), expected, rtol=1e-4, atol=1e-5)
    assert torchnative.stats()["replays"] >= 2
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

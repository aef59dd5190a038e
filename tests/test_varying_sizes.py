"""Graphs whose sizes change between calls in a way no rule of their inputs' sizes describes (a
size read quadratically; sizes that follow a rule become symbols: tests/test_sizes.py): past
SIZE_LIMIT input sizes of one op sequence, a size not compiled yet runs on eager and says why,
instead of compiling a program per size that never repays its compile. Sizes within the limit,
and one size recorded many times (a model's repeated layers), still compile."""
from __future__ import annotations

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative.cache import program_cache
from torchnative.cache.program_cache import clear_caches, programs

LIMIT = 2  # in place of SIZE_LIMIT where a test compiles a program per size: each costs a second


@pytest.fixture
def small_limit(monkeypatch):
    monkeypatch.setattr(program_cache, "SIZE_LIMIT", LIMIT)


class Cut(torch.nn.Module):
    """Each layer ends in a data read: one graph per layer, all of one op sequence and size."""

    def __init__(self, layers: int = LIMIT + 2):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = torch.tanh(layer(x))
            if x.sum().item() > 1e9:
                x = x * 0
        return x


def _compiled() -> list:
    return [p for p in programs() if any(d != "eager" for d, _ in p.partitions)]


class Quadratic(torch.nn.Module):
    """Reads n² of its n rows' values: an integer no rule a·n + c gives."""

    def __init__(self):
        super().__init__()
        self.linear = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.nn.functional.gelu(self.linear(x)).flatten()[: x.shape[0] ** 2] * 2


def test_a_size_past_the_limit_runs_on_eager_and_says_why(small_limit):
    model = Quadratic()
    eager = [Quadratic()]
    eager[0].load_state_dict(model.state_dict())
    torchnative.accelerate(model, delegates=["ort"])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad(), pytest.warns(UserWarning, match="sizes change between calls"):
        for n in range(2, LIMIT + 5):
            x = torch.randn(n, 8)
            for _ in range(3):  # compiled from its second run, within the limit
                assert_same(model(x), eager[0](x))
    # the sizes within the limit (2 and 3) run one program: two sizes fit a rule (n² too), and the
    # fit compiled in place of the second's; the first's own program was retired
    assert len(_compiled()) == 1 and torchnative.stats()["evicted"]["programs a template's runs"] == 1
    assert torchnative.stats()["not_compiled"]["sizes vary"] >= 3  # the last 3 sizes, from their first run
    e = torchnative.explain(lambda: model(torch.randn(7, 8)))
    assert [d for d, _ in e.partitions[-1]] == ["eager"]
    assert "input sizes" in e.not_compiled[-1] and "runs on eager" in e.not_compiled[-1]
    assert "not compiled" in str(e)


def test_one_size_of_repeated_layers_compiles_every_layer(small_limit):
    model = Cut()
    x = torch.randn(4, 8)
    with torch.no_grad():
        expected = model(x)
        torchnative.accelerate(model, delegates=["ort"])
        clear_caches()
        torchnative.reset_stats()
        for _ in range(3):
            assert_same(model(x), expected)
    assert not torchnative.stats()["not_compiled"]
    assert len(_compiled()) == len(model.layers)  # one per layer: each bakes its own weights

"""Graphs whose sizes change between calls (issue 22's cost rule, issue 25's symptom): past
SIZE_LIMIT input sizes of one op sequence, a size not compiled yet runs on eager and says why,
instead of compiling a program per size that never repays its compile (a decode step over
transformers' DynamicCache). Sizes within the limit, and one size recorded many times (a model's
repeated layers), still compile."""
from __future__ import annotations

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative import models
from torchnative.runtime import program_cache
from torchnative.runtime.program_cache import SIZE_LIMIT, clear_caches, programs

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


def test_a_size_past_the_limit_runs_on_eager_and_says_why(small_limit):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
    eager = [torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())]
    eager[0].load_state_dict(model.state_dict())
    torchnative.accelerate(model, delegates=["ort"])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad(), pytest.warns(UserWarning, match="sizes change between calls"):
        for n in range(1, LIMIT + 4):
            x = torch.randn(n, 8)
            for _ in range(3):  # compiled from its second run, within the limit
                assert_same(model(x), eager[0](x))
    assert len(_compiled()) == LIMIT
    assert torchnative.stats()["not_compiled"]["sizes vary"] >= 3  # the last 3 sizes, from their first run
    e = torchnative.explain(lambda: model(torch.randn(40, 8)))
    assert e.partitions[-1] == (("eager", 2),) or [d for d, _ in e.partitions[-1]] == ["eager"]
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


def test_generate_with_the_default_cache_compiles_no_decode_step_per_length():
    """Every decode step over a DynamicCache has new sizes: the second generate() compiled one
    program per step (GPT-2 small: 32 programs, 158 s); now the steps past the limit run on eager,
    and the tokens stay eager's on every call."""
    model = models.build("gpt2")
    ids = models.example_inputs("gpt2", model, seq=8)["input_ids"]
    kwargs = dict(max_new_tokens=SIZE_LIMIT + 6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kwargs)
        torchnative.accelerate(model, delegates=["ort"])
        clear_caches()
        torchnative.reset_stats()
        for _ in range(3):
            assert torch.equal(model.generate(ids, **kwargs), ref)
    assert torchnative.stats()["not_compiled"]
    assert len(_compiled()) <= SIZE_LIMIT + 2  # the prefill and its neighbours; no program per decode length

"""Fusion into named composites (passes.fuse): the patterns transformers' RMSNorm, rotary
embedding and tanh GELU record are found, each composite computes exactly what its pattern did,
a pattern is left alone when fusing it would be wrong, and ONNX Runtime maps them to its kernels."""
import onnx
import pytest
import torch

import torchnative
from torchnative import models
from torchnative.delegates import REGISTRY
from torchnative.delegates import ort as ort_delegate
from torchnative.delegates.eager import Eager
from torchnative.passes.fuse import COMPOSITES


class FusingEager(Eager):
    """Eager with every composite fused: the composites' own implementations run. Like any
    delegate it bakes the weights in: it is called with the runtime inputs alone."""
    name = "fusing-eager"
    composites = frozenset(COMPOSITES)

    def load(self, artifact):
        graph = artifact.meta["graph"]
        names = [n.name for n in graph.gm.graph.nodes if n.op == "placeholder"]

        def run(inputs):
            given = iter(inputs)
            return graph.gm.forward(*[graph.constants[n] if n in graph.constants else next(given) for n in names])
        return run


@pytest.fixture
def fusing(monkeypatch):
    monkeypatch.setitem(REGISTRY, FusingEager.name, FusingEager())
    return [FusingEager.name]


def _logits(model, inputs, delegates=None):
    with torch.no_grad():
        if delegates is None:
            return model(**inputs).logits
        torchnative.reset_stats()
        with torchnative.capture(delegates, compile_after=1):
            out = model(**inputs).logits
        return out + 0  # computed inside the block


@pytest.mark.parametrize("name, expected", [("llama", {"rms_norm": 5, "rope": 4}), ("gpt2", {"gelu_tanh": 2})])
def test_composites_compute_exactly_what_their_patterns_did(fusing, name, expected):
    model = models.build(name)
    model.config.use_cache = False
    with torch.no_grad():
        for p in model.parameters():  # norm weights start at one, where a reordered product rounds the same
            p.mul_(1 + 0.1 * torch.randn_like(p))
    inputs = models.example_inputs(name, model)
    got = _logits(model, inputs, fusing)
    assert torchnative.stats()["fused"] == expected and not torchnative.stats()["fallbacks"]
    # bit for bit what the same graph computes unfused: each composite is its pattern, op for op
    assert torch.equal(got, _logits(model, inputs, ["eager"]))


class Norms(torch.nn.Module):
    """Two RMSNorms; the second's mean square is also returned, so it cannot be fused away."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.rand(16))

    def forward(self, x):
        y = self.w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
        ms = y.pow(2).mean(-1, keepdim=True)
        return self.w * (y * torch.rsqrt(ms + 1e-6)), ms


def _rotate(x, cos, sin):
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


def test_a_pattern_whose_inner_value_is_used_elsewhere_stays(fusing):
    model, x = Norms(), torch.randn(2, 3, 16)
    torchnative.reset_stats()
    with torch.no_grad(), torchnative.capture(fusing, compile_after=1):
        y, ms = model(x)
        got = (y + 0, ms + 0)
    assert torchnative.stats()["fused"] == {"rms_norm": 1} and not torchnative.stats()["fallbacks"]
    with torch.no_grad():
        for a, b in zip(got, model(x)):
            assert torch.equal(a, b)


def test_rope_is_fused_only_when_cos_and_sin_repeat_their_halves(fusing):
    """A fused RoPE kernel reads half of cos and sin: given as inputs, nothing says the halves
    repeat, and the ops stay; built from cat([freqs, freqs]) in the graph, they are fused."""
    x, freqs = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 4)
    table = torch.cat([freqs, freqs], -1)
    for cos_sin, fused in (((torch.randn(1, 1, 5, 8), torch.randn(1, 1, 5, 8)), {}),
                           ((table.cos(), table.sin()), {}),  # real tensors: computed before capture
                           (None, {"rope": 1})):
        torchnative.reset_stats()
        with torch.no_grad(), torchnative.capture(fusing, compile_after=1):
            if cos_sin is None:
                t = torch.cat([freqs, freqs], -1)
                cos_sin = (t.cos(), t.sin())
            got = _rotate(x, *cos_sin) + 0
        assert torchnative.stats()["fused"] == fused and not torchnative.stats()["fallbacks"]
        assert torch.equal(got, _rotate(x, *cos_sin))


def test_onnx_runtime_runs_rmsnorm_and_rope_as_its_kernels(monkeypatch):
    payloads = []
    compile_ = ort_delegate.delegate.compile

    def spy(graph):
        artifact = compile_(graph)
        payloads.append(artifact.payload)
        return artifact

    monkeypatch.setattr(ort_delegate.delegate, "compile", spy)
    model = models.build("llama")
    model.config.use_cache = False
    inputs = models.example_inputs("llama", model)
    got, expected = _logits(model, inputs, ["ort"]), _logits(model, inputs)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-4
    kinds = [n.op_type for p in payloads for n in onnx.load_from_string(p).graph.node]
    # every RMSNorm and every q/k rotation
    assert (kinds.count("RMSNormalization"), kinds.count("RotaryEmbedding")) == (5, 4)
    assert torchnative.stats()["fused"] == {"rms_norm": 5, "rope": 4} and not torchnative.stats()["fallbacks"]

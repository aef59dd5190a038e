"""Fusion into named composites (passes.fuse): the patterns transformers' RMSNorm, rotary
embedding and tanh GELU record are found, each composite computes exactly what its pattern did,
a pattern is left alone when fusing it would be wrong, and ONNX Runtime maps them to its kernels."""
import onnx
import pytest
import torch

import torchnative
from torchnative import events
from torchnative import models
from torchnative.delegates import REGISTRY
from torchnative.delegates import ort as ort_delegate
from torchnative.delegates.eager import Eager
from torchnative.passes.fuse import COMPOSITES
from torchnative.passes.quantize import dequantized_copy
from tests.conftest import record


class FusingEager(Eager):
    """Eager with every composite fused: the composites' own implementations run. Like any
    delegate it bakes the weights in: it is called with the runtime inputs alone."""
    name = "fusing-eager"
    composites = frozenset(COMPOSITES)

    def load(self, artifact):
        graph = artifact.live
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


def _on_ort(f):
    """f's result and partitions under ort, compiled at once; eager's result."""
    with torch.no_grad():
        expected = f()
        torchnative.reset_stats()
        with torchnative.capture(["ort"], compile_after=1):
            e = torchnative.explain(f)
    return e, expected


def _halves_rope(x, freqs, dtype):
    t = torch.cat([freqs, freqs], -1)
    return _rotate(x, t.cos().to(dtype), t.sin().to(dtype))


@pytest.mark.parametrize("x_dtype, table_dtype", [(torch.float32, torch.int64), (torch.float32, torch.float64),
                                                  (torch.float16, torch.float32), (torch.float64, torch.float64)])
def test_rope_is_not_fused_where_its_kernel_takes_other_types(x_dtype, table_dtype):
    """RotaryEmbedding binds x, cos and sin to one type, float16/32 or bfloat16: a model that casts
    cos and sin to its ids' dtype (int64) computes x · cos in float32, and the fused node ONNX
    Runtime rejected sent its whole partition to eager. The ops stay, and ort runs them."""
    x, freqs = torch.randn(1, 2, 5, 8, dtype=x_dtype), torch.randn(1, 1, 5, 4) * 3
    e, expected = _on_ort(lambda: _halves_rope(x, freqs, table_dtype))
    assert torchnative.stats()["fused"] == {} and not torchnative.stats()["fallbacks"]
    assert [d for parts in e.partitions for d, _ in parts] == ["ort"], e
    torch.testing.assert_close(e.output, expected)


def test_rope_whose_cos_broadcasts_past_x_is_not_fused():
    """The fused kernel's result is shaped like x; cos of a larger batch makes the ops' larger."""
    x, freqs = torch.randn(1, 2, 5, 8), torch.randn(3, 1, 5, 4)
    e, expected = _on_ort(lambda: _halves_rope(x, freqs, torch.float32))
    assert torchnative.stats()["fused"] == {} and not torchnative.stats()["fallbacks"]
    assert e.output.shape == (3, 2, 5, 8)
    torch.testing.assert_close(e.output, expected)


@pytest.mark.parametrize("x_dtype, w_dtype, fused", [(torch.float16, torch.float32, {}),
                                                     (torch.float32, torch.float64, {}),
                                                     (torch.float64, torch.float64, {"rms_norm": 1})])
def test_rmsnorm_is_fused_only_when_x_and_weight_share_a_float_type(x_dtype, w_dtype, fused):
    """The composite's result has x's type; weight · x of another type promotes past it (ONNX
    Runtime rejected the fused node's output type)."""
    x, w = torch.randn(2, 3, 16, dtype=x_dtype), torch.rand(16, dtype=w_dtype)
    e, expected = _on_ort(lambda: w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6)))
    assert torchnative.stats()["fused"] == fused and not torchnative.stats()["fallbacks"]
    assert [d for parts in e.partitions for d, _ in parts] == ["ort"], e
    tolerance = {"rtol": 2e-3, "atol": 2e-3} if x_dtype == torch.float16 else {}  # float16 within, float32 out
    torch.testing.assert_close(e.output, expected, **tolerance)


def test_gelu_of_integers_is_not_fused(fusing):
    """The tanh pattern of an int64 x computes in float32; the fused Gelu takes floats only."""
    x = torch.arange(-4, 5)
    gelu = lambda t: t * 0.5 * (1.0 + torch.tanh(0.7978845608028654 * (t + torch.pow(t, 3.0) * 0.044715)))  # noqa: E731
    torchnative.reset_stats()
    with torch.no_grad(), torchnative.capture(fusing, compile_after=1):
        got = gelu(x) + 0
    assert torchnative.stats()["fused"] == {} and not torchnative.stats()["fallbacks"]
    assert torch.equal(got, gelu(x))


def _gpt2_with_biases():
    """Tiny GPT-2 without its cache; biases nonzero (GPT-2 starts them at zero, and a zero bias
    is dropped from the graph: its addmm would be an mm)."""
    model = models.build("gpt2")
    model.config.use_cache = False
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.02)
    return model, models.example_inputs("gpt2", model)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_matmuls_compute_exactly_what_their_patterns_did(fusing, scheme):
    model, inputs = _gpt2_with_biases()
    with torch.no_grad():
        torchnative.reset_stats()
        with torchnative.capture(fusing, compile_after=1, quantize=scheme):
            got = model(**inputs).logits + 0
        # 4 Conv1D per layer (addmm, their bias in it) and the tied LM head (mm)
        assert torchnative.stats()["fused"] == {"quantized_addmm": 8, "quantized_mm": 1, "gelu_tanh": 2}
        with record(events.ProgramBuilt) as built, torchnative.capture(["eager"], compile_after=1, quantize=scheme):
            unfused = model(**inputs).logits + 0
        assert torch.equal(got, unfused)
        # a program on eager alone reads the dequantized values computed once, not q and scale
        placeholders = [n for e in built for n in e.program.graph.gm.graph.nodes if n.op == "placeholder"]
        assert not any(n.meta["val"].dtype == torch.int8 for n in placeholders)
        assert any(n.name.endswith("_dequantized") for n in placeholders)
        # and that is the model with its weights dequantized, to float32 rounding of the matmuls' layouts
        torch.testing.assert_close(got, dequantized_copy(model, scheme)(**inputs).logits, rtol=0, atol=1e-5)


@pytest.mark.parametrize("scheme, kernel", [("int8", "MatMulInteger"), ("int4", "MatMulNBits")])
def test_onnx_runtime_runs_quantized_weights_on_its_low_bit_kernels(monkeypatch, scheme, kernel):
    payloads = []
    compile_ = ort_delegate.delegate.compile

    def spy(graph):
        artifact = compile_(graph)
        payloads.append(artifact)
        return artifact

    monkeypatch.setattr(ort_delegate.delegate, "compile", spy)
    model, inputs = _gpt2_with_biases()
    reference, kernels = dequantized_copy(model, scheme), dequantized_copy(model, scheme, activations=True)
    accelerated = torchnative.accelerate(model, delegates=["ort"], quantize=scheme)
    torchnative.reset_stats()
    with torch.no_grad():
        want, want_kernels = reference(**inputs).logits, kernels(**inputs).logits
        for _ in range(4):  # recorded, compiled at the second call, then replayed
            got = accelerated(**inputs).logits
    assert torchnative.stats()["replays"] >= 1 and not torchnative.stats()["fallbacks"]
    graphs = [onnx.load_from_string(a.payload).graph for a in payloads]
    kinds = [n.op_type for g in graphs for n in g.node]
    assert kinds.count(kernel) == 9 and "Gemm" not in kinds
    # MatMulNBits on its integer path (accuracy level 4: int8 activations, integer dot products)
    levels = {a.i for g in graphs for n in g.node if n.op_type == "MatMulNBits" for a in n.attribute
              if a.name == "accuracy_level"}
    assert levels == ({4} if scheme == "int4" else set())
    # the float MatMuls left are attention's, of activations: none reads a weight
    assert not [n for g in graphs for n in g.node if n.op_type == "MatMul" and set(n.input) & {i.name for i in g.initializer}]
    # the artifact keeps the graph's int8 values, not float matrices (but the embedding tables a
    # Gather reads): its low-bit layouts are made at load
    weights = [t for a in payloads for t in a.constants.values()]
    tables = {model.transformer.wte.weight.data_ptr(), model.transformer.wpe.weight.data_ptr()}
    assert sum(t.dtype == torch.int8 for t in weights) == 9
    assert {t.data_ptr() for t in weights if t.dtype == torch.float32 and t.dim() == 2} <= tables
    # both kernels quantize the activations too: the result is that of the dequantized weights
    # with the activations the kernels compute with, to float32 rounding (2-3e-7 of the largest
    # logit here); the dequantized weights' own result is ~1 % away (0.5-0.8 % here; GPT-2
    # small's logits: benchmarks/quantized_decode.py)
    top = want.abs().max()
    torch.testing.assert_close(got, want_kernels, rtol=0, atol=1e-5 * top)
    error = (got - want).abs()
    assert error.max() < 0.05 * top and error.mean() < 0.01 * top
    assert (want_kernels - want).abs().max() > 1e-3 * top  # the activations' quantization is seen


def test_generate_with_int4_weights_on_onnx_runtime_gives_the_dequantized_models_tokens():
    """As a user calls it: generate() with a static cache, three times (the later calls run the
    compiled decode step, its matmuls on MatMulNBits); the greedy tokens are those of eager with
    the dequantized weights and the activations quantized as the kernel does."""
    model = models.build("gpt2")
    ids = models.example_inputs("gpt2", model, seq=8)["input_ids"]
    reference = dequantized_copy(model, "int4", activations=True)
    kwargs = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want = reference.generate(ids, **kwargs)
        accelerated = torchnative.accelerate(model, delegates=["ort"], quantize="int4")
        torchnative.reset_stats()
        for _ in range(3):
            assert torch.equal(accelerated.generate(ids, **kwargs), want)
    assert torchnative.stats()["fused"].get("quantized_mm", 0) > 0 and not torchnative.stats()["fallbacks"]


def test_a_llama_on_the_int4_kernel_decodes_the_tokens_of_its_reference():
    """Llama's layers (q/k/v/o, gate/up/down, the LM head) on MatMulNBits: generate()'s greedy
    tokens, calls after the first on the compiled programs, are those of eager with the
    dequantized weights and the activations quantized as the kernel does, and its logits that
    model's to float32 rounding. (int8 is not compared so: on this Llama one activation of layer
    0's o_proj lies on a rounding boundary of its per-tensor quantization and lands one step apart
    in ONNX Runtime and in the reference — every other matmul agrees to 2e-7 — and later layers'
    quantization amplifies that step to 1 % of the largest logit, within int8's stated bound.)"""
    model = models.build("llama")
    ids = models.example_inputs("llama", model, seq=8)["input_ids"]
    reference = dequantized_copy(model, "int4", activations=True)
    kwargs = dict(max_new_tokens=8, do_sample=False, cache_implementation="static", pad_token_id=0)
    with torch.no_grad():
        want, logits = reference.generate(ids, **kwargs), reference(ids).logits
        accelerated = torchnative.accelerate(model, delegates=["ort"], quantize="int4")
        torchnative.reset_stats()
        for _ in range(3):
            assert torch.equal(accelerated.generate(ids, **kwargs), want)
        for _ in range(3):  # recorded, compiled, replayed
            got = accelerated(ids).logits
    assert torchnative.stats()["fused"].get("quantized_mm", 0) > 0 and not torchnative.stats()["fallbacks"]
    torch.testing.assert_close(got, logits, rtol=0, atol=1e-5 * logits.abs().max().item())


class _GatedDeltaNet(torch.nn.Module):
    """transformers' recurrent gated delta rule (Qwen3-Next's decode path) over `s` tokens, from a
    state carried in: each token's step is one delta_rule."""

    def forward(self, q, k, v, g, beta, state):
        from transformers.models.qwen3_next.modeling_qwen3_next import torch_recurrent_gated_delta_rule

        return torch_recurrent_gated_delta_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)


def _delta_inputs(s: int, b: int = 2, heads: int = 2, v_heads: int = 4, dk: int = 16, dv: int = 8):
    torch.manual_seed(s)
    return (torch.randn(b, s, heads, dk), torch.randn(b, s, heads, dk), torch.randn(b, s, v_heads, dv),
            -torch.rand(b, s, v_heads), torch.rand(b, s, v_heads), torch.randn(b, v_heads, dk, dv))


@pytest.mark.parametrize("tokens", [1, 3])
def test_gated_delta_rule_steps_compute_exactly_what_their_patterns_did(fusing, tokens):
    """Each token's step (decay, delta correction, readout) becomes one delta_rule with two
    results, the output and the new state, bit for bit eager's."""
    model, inputs = _GatedDeltaNet(), _delta_inputs(tokens)
    torchnative.reset_stats()
    with torch.no_grad(), torchnative.capture(fusing, compile_after=1):
        got = [t + 0 for t in model(*inputs)]
    assert torchnative.stats()["fused"] == {"delta_rule": tokens} and not torchnative.stats()["fallbacks"]
    with torch.no_grad():
        for a, b in zip(got, model(*inputs)):
            assert torch.equal(a, b)


def test_a_delta_rule_whose_query_is_not_scaled_by_its_root_dim_stays(fusing):
    """Core AI's composite scales the query by 1/√dk itself: a step whose query was divided by
    something else is another function, left as its ops."""
    def step(q, k, v, g, beta, state):
        q = (q / 3.0).select(2, 0)
        s = state * g.select(2, 0).exp().unsqueeze(-1).unsqueeze(-1)
        ku = k.select(2, 0).unsqueeze(-1)
        s = s + ku * ((v.select(2, 0) - (s * ku).sum(-2)) * beta.select(2, 0).unsqueeze(-1)).unsqueeze(-2)
        return (s * q.unsqueeze(-1)).sum(-2), s

    q, k, v, g, beta, state = _delta_inputs(1, heads=4)
    args = [t.transpose(1, 2).contiguous() for t in (q, k, v, g, beta)] + [state]
    torchnative.reset_stats()
    with torch.no_grad(), torchnative.capture(fusing, compile_after=1):
        got = [t + 0 for t in step(*args)]
    assert "delta_rule" not in torchnative.stats()["fused"]
    with torch.no_grad():
        for a, b in zip(got, step(*args)):
            assert torch.equal(a, b)

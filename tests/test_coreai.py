"""The `coreai` delegate (Apple Core AI through coreai-torch), executed here on coreai-core's
reference runtime: causal LMs under `accelerate` with attention, RMSNorm and RoPE as Core AI's
composite ops; generating bundles whose KV caches and sliding-window rings are Core AI
states, against eager's tokens. Its op table, models and edge cases are tests/test_delegates.py's
(it executes, so it is in EXECUTING)."""
import copy
import pathlib
import re
import tempfile

import pytest
import torch
import torch.fx as fx

import torchnative
from tests.conftest import record
from tests.test_fuse import _delta_inputs, _GatedDeltaNet
from tests.test_bundle_generate import LONG, SLIDING_CACHE, WINDOW, _bundle, _eager, _fresh_generate, _sliding
from torchnative.bundle.build import compile_generation
from torchnative.bundle.save import save
from torchnative.delegates import REGISTRY
from torchnative import events, models
from torchnative.delegates.coreml import unpack
from torchnative.passes.fuse import fuse
from torchnative.passes.quantize import dequantized

pytest.importorskip("coreai_torch")


def _function_states(bundle: pathlib.Path, method: str) -> list[list[int]]:
    """The shapes of the states of each Core AI asset of a method, as the assets declare them."""
    from coreai.authoring import AIModelAsset

    manifest = torchnative.load(bundle).manifest
    shapes = []
    for part in (p for g in manifest["methods"][method]["programs"] for p in g["partitions"]):
        assert part["delegate"] == "coreai", part["delegate"]
        assert part["meta"]["os"] == "macOS/iOS 27.0"  # the OS target the manifest names
        with tempfile.TemporaryDirectory() as tmp:
            asset = AIModelAsset.load(unpack((bundle / part["artifact"]).read_bytes(), pathlib.Path(tmp), ".aimodel"))
            shapes += [[int(d) for d in desc.split("(")[1].split(",")[1].strip(" )").split(" × ")]
                       for _, desc in asset.summary().function_states(part["meta"]["function"])]
    return shapes


def test_it_executes_here_on_the_reference_runtime():
    status = torchnative.availability()["coreai"]
    assert status.status == "executes" and "reference runtime" in status.reason


def _check_sliding(arch: str, tmp_path: pathlib.Path) -> None:
    model = _sliding(arch, tmp_path)[1]
    save(compile_generation(model, ["coreai"], cache_len=SLIDING_CACHE, prefill_len=8), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    assert not loaded.fallbacks
    declared = sorted(s["shape"] for s in loaded.manifest["state"])
    assert sorted(_function_states(tmp_path / "b", "decode")) == declared  # every ring and cache a state in decode
    assert [1, 2, WINDOW, 16] in declared
    files = {p["artifact"] for method in ("prefill", "decode") for g in loaded.manifest["methods"][method]["programs"]
             for p in g["partitions"]}
    assert len(files) == 1 and len(list((tmp_path / "b" / "partitions").iterdir())) == 1  # one asset: prefill and decode
    with torch.no_grad():
        assert torch.equal(loaded.generate(LONG, max_new_tokens=48), model.generate(LONG, max_new_tokens=48, do_sample=False))


@pytest.mark.slow  # ~28 s; a generating bundle on Core AI runs by default
def test_a_sliding_window_bundle_keeps_its_rings_as_core_ai_states(tmp_path):
    """Mistral, all layers sliding: one asset of two functions, prefill and decode, the rings
    decode's states, tokens past the window eager's."""
    _check_sliding("MistralForCausalLM", tmp_path)


@pytest.mark.slow  # ~20 s of conversion
def test_gemma3s_mixed_layers_in_one_core_ai_bundle(tmp_path):
    _check_sliding("Gemma3ForCausalLM", tmp_path)


def test_a_reduction_of_a_0d_tensor_is_refused_not_converted():
    """coreai-torch 0.4.3 aborts the process (a native assertion) converting mean or sum of a 0-d
    tensor: the delegate says no without asking it."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(())
    mean = g.call_function(torch.ops.aten.mean.default, (x,))
    mean.meta["val"] = torch.randn(())
    g.output([mean])
    verdict = REGISTRY["coreai"].supports(mean)
    assert not verdict and "aborts the process" in verdict.reason


def _composites(program) -> set[str]:
    """The Core AI composite ops the coreai partitions of a built program declare."""
    delegate, found = REGISTRY["coreai"], set()
    for step in (s for s in program.steps if s.delegate == "coreai"):
        text = str(delegate._convert({"main": fuse(step.graph, delegate.composites)}))
        found |= set(re.findall(r'composite_declaration<"(\w+)"', text))
    return found


@pytest.mark.parametrize(("name", "composites"), [
    ("gpt2", {"scaled_dot_product_attention", "layer_norm"}),  # coreai-torch makes its own of LayerNorm
    ("llama", {"scaled_dot_product_attention", "rms_norm", "rope"}),
    ("qwen3", {"scaled_dot_product_attention", "rms_norm", "rope"})])  # grouped KV heads, q/k norms
def test_causal_lms_run_whole_on_core_ai_with_its_composite_ops(name, composites):
    """accelerate(delegates=["coreai"]): every op of the forward in Core AI, attention, RMSNorm and
    RoPE declared as Core AI's composites (a device runs its fused kernels), compiled and replayed
    calls eager's (1e-4) on the reference runtime."""
    model = models.transformers_model({"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM",
                                       "qwen3": "Qwen3ForCausalLM"}[name], use_cache=True)
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["coreai"], compile_after=1, background=False)
    with torch.no_grad():
        for seq in (12, 12, 12):  # recorded, compiled, replayed
            ids = torch.randint(0, model.config.vocab_size, (2, seq))
            torch.testing.assert_close(model(ids, use_cache=False).logits, reference(ids, use_cache=False).logits,
                                       rtol=1e-4, atol=1e-4)
        with torchnative.capture(["coreai"], compile_after=1, background=False):
            e = torchnative.explain(lambda: reference(ids, use_cache=False).logits)
    assert not e.fallbacks and all(d == "coreai" for parts in e.partitions for d, _ in parts), e.partitions
    assert _composites(e.programs[0]) == composites


def _llama_on_coreai(quantize: str | None):
    model, ids = models.build("llama"), torch.randint(0, 1000, (2, 12))
    with torch.no_grad(), torchnative.capture(["coreai"], compile_after=1, background=False, quantize=quantize):
        e = torchnative.explain(lambda: model(ids, use_cache=False).logits)
    with torch.no_grad(), torchnative.capture(["eager"], compile_after=1, background=False, quantize=quantize):
        reference = torchnative.explain(lambda: model(ids, use_cache=False).logits).output  # the dequantized weights'
    assert not e.fallbacks and [d for parts in e.partitions for d, _ in parts] == ["coreai"], e.partitions
    torch.testing.assert_close(e.output, reference, rtol=1e-4, atol=1e-5)
    (step,) = e.programs[0].steps
    return step, str(REGISTRY["coreai"]._convert({"main": fuse(step.graph, REGISTRY["coreai"].composites)}))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_weights_are_core_ai_compressed_weights(scheme):
    """quantize=int8|int4: every linear layer's weight a constant of its integers' width (int4 packed),
    expanded by Core AI's blockwise_shift_scale in the program; logits eager's with the
    dequantized weights; the asset smaller than float32's by what the weights shrank."""
    step, program = _llama_on_coreai(scheme)
    assert program.count("coreai.blockwise_shift_scale") == 15  # 2 layers × 7 linears + the LM head
    assert ("xsi4>" in program) == (scheme == "int4")
    float_step, _ = _llama_on_coreai(None)
    assert step.artifact_bytes < float_step.artifact_bytes * (0.6 if scheme == "int8" else 0.5)


def test_palettized_weights_are_core_ai_lookups():
    """quantize=palettize4: every linear layer's weight Core AI's lut_to_dense of 4-bit indices and a
    table per output channel (the float weight not in the asset); logits eager's with the
    palettized values, which are each channel's 16 values."""
    step, program = _llama_on_coreai("palettize4")
    assert program.count("coreai.lut_to_dense") == 15  # 2 layers × 7 linears + the LM head
    assert "xui4>" in program
    float_step, _ = _llama_on_coreai(None)
    # rows of 64 values: a 16-entry float table per row weighs twice its indices; the float embedding stays
    assert step.artifact_bytes < float_step.artifact_bytes * 0.65
    w = models.build("llama").lm_head.weight
    assert all(len(row.unique()) <= 16 for row in dequantized(w, "palettize4"))
    assert (dequantized(w, "palettize4") - w).norm() < 0.15 * w.norm()


@pytest.mark.parametrize("quantize", [None, pytest.param("palettize4", marks=pytest.mark.slow)])  # ~8 s
def test_a_generating_bundle_generates_eager_s_tokens_in_a_fresh_process(tmp_path, quantize):
    """capture-and-compile --targets coreai [--quantize palettize4]: one asset, its KV caches Core AI
    states; a fresh process generates the tokens of the model (with the palettized values: they
    change the tokens, so the lookups are what ran)."""
    extra = ("--quantize", quantize) if quantize else ()
    bundle, config = _bundle("GPT2LMHeadModel", tmp_path, "--targets", "coreai", *extra)
    manifest = torchnative.load(bundle).manifest
    assert {p["delegate"] for m in manifest["methods"].values() for g in m["programs"] for p in g["partitions"]} == {"coreai"}
    assert sorted(_function_states(bundle, "decode")) == sorted(s["shape"] for s in manifest["state"])
    expected = _eager("GPT2LMHeadModel", config, quantize)
    if quantize:
        assert not torch.equal(expected, _eager("GPT2LMHeadModel", config))
    assert torch.equal(_fresh_generate(bundle, tmp_path), expected)


@pytest.mark.parametrize("name", ["llama", pytest.param("gpt2", marks=pytest.mark.slow)])  # gpt2's: ~6 s, no RoPE
def test_prompts_of_new_lengths_run_on_core_ai_functions_with_dims_that_vary(name):
    """generate() at a new prompt length every call over DynamicCache: the graphs whose sizes vary
    (templates) compiled once as Core AI functions with `?` dims (RoPE's composite among them), every
    call's tokens eager's."""
    from torchnative.sizes import SIZES

    model = models.build(name)
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["coreai"], compile_after=2, background=False)
    torchnative.reset_stats()
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0)
    with record(events.PartitionCompiled) as built, torch.no_grad():
        for n in (8, 11, 13, 9, 15):
            ids = torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n))
            assert torch.equal(model.generate(ids, **kwargs), reference.generate(ids, **kwargs)), n
    assert not torchnative.stats()["fallbacks"], torchnative.stats()["fallbacks"]
    varying = [e.step for e in built if e.step.delegate == "coreai" and any(SIZES in n.meta for n in e.step.graph.gm.graph.nodes)]
    assert varying and "?x" in str(REGISTRY["coreai"]._convert({"main": fuse(varying[0].graph, REGISTRY["coreai"].composites)}))


@pytest.mark.parametrize("tokens", [1, 3])
def test_a_gated_delta_rule_is_core_ai_s_composite(tokens):
    """transformers' recurrent gated delta rule (Qwen3-Next's decode) on coreai: each token's step
    Core AI's gated_delta_update composite (query before its 1/√dk scaling, as the composite
    declares), the whole rule one partition, output and state eager's."""
    model, inputs = _GatedDeltaNet(), _delta_inputs(tokens)
    torchnative.reset_stats()
    with torch.no_grad(), torchnative.capture(["coreai"], compile_after=1, background=False):
        e = torchnative.explain(lambda: model(*inputs))
    assert not e.fallbacks and [d for parts in e.partitions for d, _ in parts] == ["coreai"], e.partitions
    assert torchnative.stats()["fused"]["delta_rule"] == tokens
    for got, expected in zip(e.output, model(*inputs)):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    (step,) = e.programs[0].steps
    program = str(REGISTRY["coreai"]._convert({"main": fuse(step.graph, REGISTRY["coreai"].composites)}))
    assert 'composite_declaration<"gated_delta_update"' in program
    assert len(re.findall(r"coreai.invoke @gated_delta_update_\w+\(", program)) == tokens  # the state chained token to token


@pytest.mark.slow
def test_qwen3_next_generates_eager_s_tokens_with_its_delta_rule_on_core_ai():
    """A Qwen3-Next tiny config (gated DeltaNet layers beside attention) under accelerate on coreai:
    greedy tokens eager's, the decode step's delta rule fused."""
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    config = Qwen3NextConfig(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
                             linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16, num_experts=4,
                             num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=32,
                             layer_types=["linear_attention", "full_attention"], max_position_embeddings=256)
    torch.manual_seed(0)
    model, ids = Qwen3NextForCausalLM(config).eval(), torch.randint(0, 1000, (1, 8))
    with torch.no_grad():
        expected = model.generate(ids, max_new_tokens=4, do_sample=False)
    torchnative.accelerate(model, delegates=["coreai"], compile_after=1, background=False)
    torchnative.reset_stats()
    with torch.no_grad():
        assert torch.equal(model.generate(ids, max_new_tokens=4, do_sample=False), expected)
    assert torchnative.stats()["fused"]["delta_rule"] >= 1 and not torchnative.stats()["fallbacks"]


class _FastWeights(torch.nn.Module):
    """A TTT-style layer: each call takes one gradient step of its fast weight W on a
    reconstruction loss over the call's tokens, in place, then reads through the new W."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.proj = torch.nn.Linear(d, d)
        self.register_buffer("W", torch.eye(d))
        self.lr = 0.1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        k = self.proj(x)
        error = k @ self.W - x
        self.W.sub_(self.lr * k.transpose(-1, -2) @ error / x.shape[0])
        return torch.nn.functional.rms_norm(k @ self.W, self.W.shape[:1])


def test_a_fast_weight_layer_streams_on_core_ai_as_eager_does():
    """10 streaming calls: outputs and the fast weight eager's after every call (1e-5), the whole
    step (the update included) in one Core AI partition, calls replayed."""
    torch.manual_seed(0)
    model = _FastWeights().eval()
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["coreai"], compile_after=1, background=False)
    torchnative.reset_stats()
    with torch.no_grad():
        for _ in range(10):
            x = torch.randn(8, 16)
            torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.W, reference.W, rtol=1e-5, atol=1e-6)
        assert not torch.equal(model.W, torch.eye(16)) and torchnative.stats()["replays"] >= 8
        with torchnative.capture(["coreai"], compile_after=1, background=False):
            e = torchnative.explain(lambda: reference(x))
    assert [d for parts in e.partitions for d, _ in parts] == ["coreai"], e.partitions


def test_a_fast_weight_is_a_core_ai_state():
    """The fast weight W, written whole by the step and read by nothing outside its partition, is a
    state of the Core AI function (updated in place by the runtime), not an input and an output;
    streaming calls stay eager's."""
    torch.manual_seed(0)
    model = _FastWeights().eval()
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["coreai"], compile_after=1, background=False)
    with torch.no_grad(), record(events.PartitionCompiled) as built:
        for _ in range(4):
            x = torch.randn(8, 16)
            torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.W, reference.W, rtol=1e-5, atol=1e-6)
    step = next(e.step for e in built if e.step.delegate == "coreai")
    assert step.graph.written_into  # W's new value, and nothing outside the partition reads the old one
    meta = REGISTRY["coreai"].compile(step.graph).meta
    (state, k), = meta["states"]
    placeholder = next(p for p in step.graph.placeholders() if p.name == state)
    assert placeholder.meta["val"].shape == (16, 16) and state not in meta["inputs"]  # W
    assert [k] in meta["outputs"]  # its new value is the state itself, not a Core AI output


def test_a_fast_weight_stays_float_beside_palettized_weights():
    """quantize=palettize4 on a fast-weight layer: its projection palettized (a Core AI lookup), its
    fast weight W a float state, never palettized: calls equal eager with the projection's
    palettized values, W included."""
    torch.manual_seed(0)
    model = _FastWeights(64).eval()
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.proj.weight.copy_(dequantized(model.proj.weight, "palettize4"))
    torchnative.accelerate(model, delegates=["coreai"], compile_after=1, background=False, quantize="palettize4")
    with torch.no_grad(), record(events.PartitionCompiled) as built:
        for _ in range(4):
            x = torch.randn(8, 64)
            torch.testing.assert_close(model(x), reference(x), rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(model.W, reference.W, rtol=1e-5, atol=1e-6)
    (step,) = [e.step for e in built if e.step.delegate == "coreai"]
    program = str(REGISTRY["coreai"]._convert({"main": step.graph}))
    assert program.count("coreai.lut_to_dense") == 1 and "64x64xf32" in program  # proj's lookup; W float
    assert not torch.equal(reference.proj.weight, model.proj.weight)


def test_a_static_cache_and_its_counters_are_states_of_one_function():
    """GPT-2's decode over a static cache writes its KV tensors in place and its position counters
    whole: all are states of the Core AI function, named as the converter orders them (a swap of
    names made the runtime refuse a cache as int32), and the check finds every partition exact."""
    model = models.build("gpt2")
    ids = models.example_inputs("gpt2", model, seq=8)["input_ids"]
    kwargs = dict(max_new_tokens=8, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(ids, **kwargs)
    torchnative.accelerate(model, delegates=["coreai"])
    torchnative.reset_stats()
    with record(events.PartitionCompiled) as built:
        assert torch.equal(model.generate(ids, **kwargs), expected)
    assert not torchnative.stats()["fallbacks"], torchnative.stats()["fallbacks"]
    written = [e.step.graph for e in built if e.step.delegate == "coreai" and e.step.graph.written_into]
    assert written  # counters written whole, kept as states

"""Tensors that change at test time: BN statistics (TTA stage 0), adapted parameters (TENT, stage
1), fast weights carried across calls (TTT-Linear), a KV cache; each against the eager loop, and
pinned/state tensors never folded or quantized."""
import copy

import pytest
import torch

import torchnative
from torchnative import events
from torchnative.passes.quantize import dequantized
from torchnative.cache.program_cache import clear_caches
from tests.conftest import record

DELEGATES = ["ort"]


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    """One disk cache for the module: train-mode BatchNorm splits the ResNet into ~18 ONNX
    partitions (~1 s each to export); the tests after the first load the ones they share."""
    torchnative.set_cache_dir(tmp_path_factory.mktemp("pinning-cache"))
    yield
    torchnative.set_cache_dir(None)


def _resnet_classifier():
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    cfg = ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic", num_labels=10)
    return ResNetForImageClassification(cfg)


def _batches(n, shape=(4, 3, 32, 32)):
    g = torch.Generator().manual_seed(3)
    return [torch.randn(*shape, generator=g) * 1.5 + 0.3 for _ in range(n)]


def _bn_stats(model):
    return {k: v for k, v in model.state_dict().items() if "running" in k or "num_batches" in k}


def _programs_built(fn):
    with record(events.ProgramBuilt) as seen:
        fn()
    return seen


def test_tta_stage0_bn_statistics_reestimated_on_test_batches():
    eager = _resnet_classifier().train()
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=DELEGATES)
    with torch.no_grad():
        for x in _batches(10):
            torch.testing.assert_close(accel(pixel_values=x).logits, eager(pixel_values=x).logits, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(_bn_stats(accel), _bn_stats(eager), rtol=1e-5, atol=1e-6)


def _entropy(logits):
    return -(logits.softmax(-1) * logits.log_softmax(-1)).sum(-1).mean()


def _tent_setup(model):
    model.train()
    model.requires_grad_(False)
    params = []
    for m in model.modules():
        if isinstance(m, torch.nn.BatchNorm2d):
            m.weight.requires_grad_(True)
            m.bias.requires_grad_(True)
            params += [m.weight, m.bias]
    return params, torch.optim.SGD(params, lr=0.05, momentum=0.9)


def _with_dequantized_weights(model, scheme):
    """The eager reference for a quantized run: matmul/conv weights as the graph dequantizes them."""
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.copy_(dequantized(p, scheme))
    return model


@pytest.mark.parametrize("quantize", [None, "int8"])
def test_tta_stage1_tent_adapts_bn_affine_parameters_like_eager(quantize):
    """With `quantize`, the graphs autograd records stay float (backward runs on the float weights
    autograd saved above the door): the adaptation equals eager's. Evaluation under no_grad
    is quantized: it equals eager with the conv/linear weights dequantized, the adapted BN
    parameters float32 inputs of the program."""
    eager = _resnet_classifier()
    accel = copy.deepcopy(eager)
    e_params, e_opt = _tent_setup(eager)
    a_params, a_opt = _tent_setup(accel)
    torchnative.pin(a_params[0])  # one pinned by hand; the others are pinned when they change
    # as in a fresh process: a graph structure seen before (the other parametrization) compiles
    # at its first run, before a step has written any weight, and would bake the BN parameters
    clear_caches()
    torchnative.reset_stats()
    with record(events.ProgramBuilt) as built:
        torchnative.accelerate(accel, delegates=DELEGATES, quantize=quantize)
        for x in _batches(10):
            e_out = eager(pixel_values=x).logits
            a_out = accel(pixel_values=x).logits
            torch.testing.assert_close(a_out, e_out, rtol=1e-4, atol=1e-5)
            for out, opt in ((e_out, e_opt), (a_out, a_opt)):
                _entropy(out).backward()
                opt.step()
                opt.zero_grad()
            for a, e in zip(a_params, e_params):
                torch.testing.assert_close(a, e, rtol=1e-4, atol=1e-5)
    assert any(p is a_params[0] for p in torchnative.pinned())
    # no program baked an adapted parameter: each is a float32 input wherever a delegate reads it
    for event in built:
        for _, ref, _ in event.program.baked:
            assert not any(ref() is p for p in a_params)
    if quantize is None:
        return
    assert torchnative.stats()["quantized"].get(
        "not quantized: autograd records the graph (run under torch.no_grad() to quantize)", 0) > 0
    x = _batches(1)[0]
    reference = _with_dequantized_weights(copy.deepcopy(eager), quantize)
    with record(events.ProgramBuilt) as evaluated, torch.no_grad():
        outs = [accel(pixel_values=x).logits for _ in range(3)]
        # the convolutions compute with their dequantized weights, the classifier on ONNX Runtime's int8 kernel
        _close_to_dequantized(outs[-1], reference(pixel_values=x).logits)
    graph = evaluated[-1].program.graph
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    assert any(p.meta["val"].dtype == torch.int8 for p in placeholders), "the conv weights are int8"
    inputs = dict(zip(placeholders, graph.input_roles))
    bn = [p for p, role in inputs.items() if role == "pinned"]
    assert bn and all(p.meta["val"].dtype == torch.float32 for p in bn)


def _close_to_dequantized(got, want):
    """Within ONNX Runtime's int8 kernel's error of eager with the dequantized weights: its
    MatMulInteger quantizes the activations too (2 % of the largest value)."""
    torch.testing.assert_close(got, want, rtol=0, atol=0.02 * want.abs().max().item())


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 64), torch.nn.GELU(),
                               torch.nn.Linear(64, 8))


def test_quantize_int8_leaves_pinned_submodule_float():
    model = _mlp()
    torchnative.pin(model[2])
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for i in (0, 4):  # what the graph computes for the unpinned weights
            reference[i].weight.copy_(dequantized(model[i].weight, "int8"))
    x = torch.randn(5, 32)
    torchnative.accelerate(model, delegates=DELEGATES, quantize="int8")
    with torch.no_grad():
        built = _programs_built(lambda: [model(x) for _ in range(3)])
        _close_to_dequantized(model(x), reference(x))
    graph = built[-1].program.graph
    roles = dict(zip([n.name for n in graph.gm.graph.nodes if n.op == "placeholder"], graph.input_roles))
    placeholders = {n.name: n for n in graph.gm.graph.nodes if n.op == "placeholder"}
    int8 = [n for n, p in placeholders.items() if p.meta["val"].dtype == torch.int8]
    assert len(int8) == 2, "the two unpinned weights are int8 in the compiled graph"
    pinned = [n for n, r in roles.items() if r == "pinned"]
    shapes = sorted(list(placeholders[n].meta["val"].shape) for n in pinned)
    assert shapes == [[64], [64, 64]], "model[2]'s weight and bias"
    for n in pinned:
        assert placeholders[n].meta["val"].dtype == torch.float32 and placeholders[n].users
    assert torchnative.stats()["quantized"].get("int8: quantized", 0) >= 2
    torchnative.deaccelerate(model)


def test_weight_written_between_runs_is_pinned_once():
    model = _mlp()
    x = torch.randn(5, 32)
    torchnative.accelerate(model, delegates=DELEGATES)
    torchnative.reset_stats()
    with torch.no_grad():
        for _ in range(3):
            model(x)
        built_before = torchnative.stats()["graphs_built"]
        for step in range(4):  # an in-place update between runs, as an optimizer would
            model[0].weight.add_(0.01)
            out = model(x)
            torch.testing.assert_close(out, torchnative.deaccelerate(model)(x), rtol=1e-5, atol=1e-6)
            torchnative.accelerate(model, delegates=DELEGATES)
    s = torchnative.stats()
    assert list(s["pinned"]) == ["0.weight"] and "written between two runs" in s["pinned"]["0.weight"]
    assert s["graphs_built"] - built_before == 1, "one rebuild, then the pinned program serves every update"


# -- fast weights: a TTT-Linear-style layer ------------------------------------------------------
class FastWeights:
    """Carried across calls: per batch and head, the fast weight W [d, d]."""

    def __init__(self):
        self.W = None


class TTTLinear(torch.nn.Module):
    """Per head a fast weight W, updated inside forward by the closed-form gradient of the
    reconstruction loss ||k W - v||² / b over each mini-batch of b tokens (no autograd), then read
    by the queries of that mini-batch."""

    def __init__(self, dim=32, heads=2, mini_batch=4, lr=0.5):
        super().__init__()
        torch.manual_seed(0)
        self.heads, self.d, self.b, self.lr = heads, dim // heads, mini_batch, lr
        self.qkv = torch.nn.Linear(dim, 3 * dim)
        self.out = torch.nn.Linear(dim, dim)
        self.W0 = torch.nn.Parameter(torch.randn(heads, self.d, self.d) * 0.1)  # initial fast weight

    def forward(self, x, state: FastWeights):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.heads, self.d).permute(2, 0, 3, 1, 4)  # [B, H, T, d] each
        k = k / k.norm(dim=-1, keepdim=True)
        W = state.W if state.W is not None else self.W0.expand(B, -1, -1, -1)
        outs = []
        for s in range(0, T, self.b):
            kb, vb, qb = k[:, :, s:s + self.b], v[:, :, s:s + self.b], q[:, :, s:s + self.b]
            grad = (2.0 / self.b) * kb.transpose(-1, -2) @ (kb @ W - vb)
            W = W - self.lr * grad
            outs.append(qb @ W)
        state.W = W
        y = torch.cat(outs, dim=2).transpose(1, 2).reshape(B, T, -1)
        return self.out(y)


def _stream(model, chunks):
    state, outs = FastWeights(), []
    with torch.no_grad():
        for c in chunks:
            outs.append(model(c, state))
    return outs, state.W


def test_fast_weights_stream_like_eager_and_are_never_quantized():
    g = torch.Generator().manual_seed(5)
    chunks = [torch.randn(2, 8, 32, generator=g) for _ in range(8)]
    eager = TTTLinear()
    expected, expected_W = _stream(eager, chunks)
    # fp32: every chunk's output and the carried fast weights equal eager's
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=DELEGATES)
    got, W = _stream(model, chunks)
    for a, b in zip(got, expected):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(W, expected_W, rtol=1e-4, atol=1e-5)
    # int8: the projections are quantized, the fast weight never is: the result is that of eager
    # with the dequantized projection weights (to the int8 kernel's error), however far W drifts
    # over the 8 chunks
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=DELEGATES, quantize="int8")
    reference = copy.deepcopy(eager)
    with torch.no_grad():
        for lin in (reference.qkv, reference.out):
            lin.weight.copy_(dequantized(lin.weight, "int8"))
    streamed = []
    built = _programs_built(lambda: streamed.append(_stream(model, chunks)))
    got, W = streamed[0]
    expected, expected_W = _stream(reference, chunks)
    for a, b in zip(got, expected):
        _close_to_dequantized(a, b)
    _close_to_dequantized(W, expected_W)
    # in the compiled graph of a later chunk, W ([B, H, d, d]) is a float runtime input that feeds
    # matmuls directly: not baked, folded or quantized
    graph = built[-1].program.graph
    placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
    fast = [(p, r) for p, r in zip(placeholders, graph.input_roles) if list(p.meta["val"].shape) == [2, 2, 16, 16]]
    assert len(fast) == 1 and fast[0][1] == "input" and fast[0][0].meta["val"].dtype == torch.float32
    assert {u.target for u in fast[0][0].users} <= {torch.ops.aten.expand.default, torch.ops.aten.view.default,
                                                     torch.ops.aten.bmm.default, torch.ops.aten.sub.Tensor}
    assert sum(p.meta["val"].dtype == torch.int8 for p in placeholders) == 2  # qkv and out weights


# -- LLM decode with a StaticCache -----------------------------------------------------------------
def test_static_cache_decode_reuses_one_compiled_graph_and_cache_buffers_are_state():
    from torchnative import models

    model = models.build("gpt2")
    ids = models.example_inputs("gpt2", model, seq=8)["input_ids"]
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0, cache_implementation="static")
    expected = model.generate(ids, **kwargs)
    torchnative.accelerate(model, delegates=DELEGATES, replay=False)  # every step recorded at the door
    runs = []
    stop = events.listen(lambda e: runs.append(e) if isinstance(e, events.GraphRun) else None)
    try:
        torchnative.reset_stats()
        got = model.generate(ids, **kwargs)
    finally:
        stop()
        torchnative.deaccelerate(model)
    assert torch.equal(got, expected)
    steps = kwargs["max_new_tokens"] - 1  # decode steps after the prefill
    decode = [r for r in runs if "state" in r.graph.input_roles and r.graph.input_roles.count("state") >= 4]
    keys = {r.graph.key for r in decode}
    built = torchnative.stats()["graphs_built"]
    print(f"StaticCache decode: {steps} steps, {len(decode)} graph runs writing the cache, "
          f"{len(keys)} distinct decode graph(s), {built} programs built in all")
    # the decode graph writes 2 layers × (key, value) cache buffers in place: state, written back
    assert all(r.graph.output_roles.count("state_update") == r.graph.input_roles.count("state") for r in decode)
    assert len(decode) >= steps and len(keys) == 1, "one decode graph, reused by every step"
    assert all(r.partitions and any(d == "ort" for d, _ in r.partitions) for r in decode[2:])
    # each cache is written in place where the step writes it (passes.state), not copied back whole
    program = decode[-1].program
    assert sum(n.target is torch.ops.aten.index_put_.default for n in program.graph.op_nodes()) == 4
    cache_shapes = {tuple(n.meta["val"].shape) for n in program.graph.gm.graph.nodes
                    if n.op == "placeholder" and n.meta.get("role") == "state" and n.meta["val"].dim() == 4}
    assert cache_shapes and all(tuple(o.meta["val"].shape) not in cache_shapes
                                for s in program.steps if s.delegate == "ort" for o in s.outputs)


def test_explain_and_stats_name_pinned_and_state_tensors():
    model = _resnet_classifier().train()  # BatchNorm statistics are written inside the graph
    torchnative.pin(model.classifier)
    with torch.no_grad():
        e = torchnative.explain(model, pixel_values=_batches(1)[0])
    tensors = e.updatable
    state = {n for n, (role, _) in tensors.items() if role == "state"}
    assert "resnet.embedder.embedder.normalization.running_mean" in state
    assert len(state) == 3 * sum(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())
    assert tensors["classifier.1.weight"] == ("pinned", "pinned by torchnative.pin()")
    text = str(e)
    assert "state resnet.embedder.embedder.normalization.running_var: written in place inside the graph" in text
    assert "pinned classifier.1.weight: pinned by torchnative.pin()" in text

"""Passes on their own: constant folding (what weights alone determine is computed once, at
build; never from pinned tensors; recomputed when a weight changes; autograd unaffected), a
state's slice writes in place, GGUF k-quant weights."""
import pytest
import torch

import torchnative
from torchnative import events
from torchnative.build.program import CapturedOpError
from tests.conftest import record

aten = torch.ops.aten


class Rotary(torch.nn.Module):
    """A scaled weight and a RoPE-style table from a buffer and arange: all foldable."""

    def __init__(self):
        super().__init__()
        self.w = torch.nn.Parameter(torch.randn(16, 16))
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, 16, 2).float() / 16))

    def forward(self, x):
        angles = torch.arange(x.shape[0]).float()[:, None] * self.inv_freq[None, :]
        table = torch.cat([angles.cos(), angles.sin()], -1)
        return (x * table) @ (self.w * 0.5).t()


def _built(model, x):
    """The output and the graph of the program built for `model(x)` (buffers are weights, as
    under `accelerate`)."""
    torchnative.accelerate(model, delegates=["eager"], compile_after=1, replay=False)
    try:
        with record(events.ProgramBuilt) as built:
            y = model(x)
    finally:
        torchnative.deaccelerate(model)
    return y, built[-1].program.graph


def _weight_scaled(graph) -> bool:
    """Does the graph still compute `w * 0.5`?"""
    return any(n.target is aten.mul.Tensor and n.args[1] == 0.5 for n in graph.op_nodes())


def test_folds_what_weights_alone_determine():
    model, x = Rotary(), torch.randn(8, 16)
    torchnative.reset_stats()
    y, graph = _built(model, x)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    ops = set(graph.ops())
    assert not _weight_scaled(graph) and not {"aten.cos.default", "aten.sin.default", "aten.arange.start_step"} & ops
    assert graph.input_roles.count("constant") == 2  # the scaled weight and the table
    assert torchnative.stats()["folded"] == 2


def test_nothing_read_from_a_pinned_tensor_is_folded():
    model, x = Rotary(), torch.randn(8, 16)
    torchnative.pin(model.w)
    y, graph = _built(model, x)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    assert _weight_scaled(graph) and graph.input_roles.count("constant") == 1  # the table only


def test_a_changed_weight_is_not_served_from_an_old_fold():
    model, x = Rotary(), torch.randn(8, 16)
    for _ in range(3):
        with torchnative.capture(["ort"], compile_after=1):
            y = model(x)
        torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-5)
        with torch.no_grad():
            model.w.mul_(1.5)  # an update between calls, as test-time training makes


def test_gradients_flow_to_a_folded_weight():
    model, x = Rotary(), torch.randn(8, 16)
    reference = Rotary()
    reference.load_state_dict(model.state_dict())
    reference(x).square().sum().backward()
    with torchnative.capture(["ort"], compile_after=1):
        model(x).square().sum().backward()
    torch.testing.assert_close(model.w.grad, reference.w.grad, rtol=1e-5, atol=1e-5)


def test_a_zero_bias_is_dropped_and_its_change_rebuilds_the_program():
    model, x = torch.nn.Linear(16, 8), torch.randn(4, 16)
    torch.nn.init.zeros_(model.bias)
    y, graph = _built(model, x)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    assert "aten.mm.default" in graph.ops() and "aten.addmm.default" not in graph.ops()
    with torch.no_grad():
        model.bias.add_(1.0)  # the bias learns: the program built without it is stale
    y, graph = _built(model, x)
    torch.testing.assert_close(y, model(x), rtol=0, atol=0)
    assert "aten.addmm.default" in graph.ops()
    for _ in range(3):
        with torchnative.capture(["ort"], compile_after=1):
            y = model(x)
        torch.testing.assert_close(y, model(x), rtol=1e-6, atol=1e-6)
        with torch.no_grad():
            model.bias.copy_(torch.zeros(8) if model.bias.any() else torch.ones(8))


class CacheWrite(torch.nn.Module):
    """A KV-cache-like buffer written at given positions, then read whole (as attention does),
    and a counter of the steps (StaticCache's). `peek`: the old cache is also read before the
    write; `add`: the write accumulates."""

    def __init__(self, peek=False, add=False):
        super().__init__()
        self.proj = torch.nn.Linear(8, 8)
        self.register_buffer("cache", torch.zeros(1, 2, 6, 8))
        self.register_buffer("steps", torch.zeros((), dtype=torch.long))
        self.peek, self.add = peek, add

    def forward(self, x, pos):
        k = self.proj(x).view(1, 1, -1, 8).expand(1, 2, -1, 8)
        old = self.cache.sum() if self.peek else 0.0
        if self.add:
            self.cache.index_add_(2, pos, k)
        else:
            self.cache.index_copy_(2, pos, k)
        self.steps.add_(1)
        return (self.cache * 2).sum(2) + old


def _stream(model, steps=4):
    """Outputs and cache after writing position i at step i (the program is built at step 2)."""
    g = torch.Generator().manual_seed(1)
    xs = [torch.randn(1, 8, generator=g) for _ in range(steps)]
    outs = [model(x, torch.tensor([i])) for i, x in enumerate(xs)]
    assert model.steps.item() == steps
    return outs, model.cache.clone()


def _writes_in_place(graph) -> int:
    return sum(n.target is aten.index_put_.default for n in graph.op_nodes())


@pytest.mark.parametrize("variant", ["write", "peek", "add"])
def test_cache_slice_write_becomes_one_in_place_update(variant):
    kwargs = {"peek": variant == "peek", "add": variant == "add"}
    torch.manual_seed(0)
    eager = CacheWrite(**kwargs)
    accelerated = CacheWrite(**kwargs)
    accelerated.load_state_dict(eager.state_dict())
    with torch.no_grad():
        expected, expected_cache = _stream(eager)
    torchnative.accelerate(accelerated, delegates=["ort"], replay=False)
    try:
        with torch.no_grad(), record(events.ProgramBuilt) as built:
            got, cache = _stream(accelerated)
    finally:
        torchnative.deaccelerate(accelerated)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g, e, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(cache, expected_cache, rtol=1e-5, atol=1e-6)
    program = built[-1].program
    writes = _writes_in_place(program.graph)
    if variant == "write":
        # ONNX Runtime writes the caller's cache in place (its ScatterND's output bound to the
        # cache's buffer): one partition, and no output of the cache's shape to copy back
        assert writes == 1
        assert [d for d, _ in program.partitions] == ["ort"]
        cache_shape = tuple(accelerated.cache.shape)
        assert all(tuple(n.meta["val"].shape) != cache_shape for n in program.steps[0].outputs)
        # the counter's new value is only copied into the counter: the runner may reuse its buffer
        assert program.steps[0].graph.output_roles.count("written_back") == 1
    else:  # the old cache is read as well, or the write adds: a whole new value, copied back
        assert writes == 0


def test_a_program_given_a_list_of_another_length_says_so():
    """A program finds each value by its position: a longer list (inputs with the constants a pass
    made already appended) is an error naming both lengths, not values taken from wrong places."""
    model = CacheWrite()
    torchnative.accelerate(model, delegates=["ort"], replay=False)
    try:
        with torch.no_grad(), record(events.ProgramBuilt) as built:
            _stream(model)
    finally:
        torchnative.deaccelerate(model)
    program = built[-1].program
    inputs = [torch.zeros(1)] * (len(program.graph.input_roles) - len(program.extra) + 1)
    with pytest.raises(CapturedOpError, match=f"a program of {len(inputs) - 1} inputs was given {len(inputs)}"):
        program(inputs)


def test_kquant_weights_become_dequantized_constants_carrying_their_blocks():
    """quantize="q4k" on its own: a matmul's weight operand (the param through its views) becomes a
    constant of its k-quant's dequantized values, the candle QTensor in its meta, and the view is
    gone; a pinned weight, and one whose input dimension does not fill 256-wide blocks, stay."""
    pytest.importorskip("candle", reason="the k-quants are made by candle (pip install candle-nn==0.4.2)")
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx
    from torch.nn.functional import linear

    from torchnative.ir import CapturedGraph
    from torchnative.passes.derived import Derived
    from torchnative.passes.quantize import dequantized, quantize_weights

    def f(x, w1, w2, w3):
        return (linear(linear(linear(x, w1), w2), w3),)

    args = [torch.randn(4, 256), torch.randn(512, 256), torch.randn(96, 512), torch.randn(8, 96)]
    gm = make_fx(f, decomposition_table=core_aten_decompositions())(*args)
    graph = CapturedGraph(gm, ["input", "param", "pinned", "param"], ["output"], {})
    derived = Derived()
    torchnative.reset_stats()
    graph = quantize_weights(graph, args, "q4k", derived)
    kquants = [n for n in graph.gm.graph.nodes if "kquant" in n.meta]
    assert len(kquants) == 1 and derived.sources == {1} and graph.input_roles[-1] == "constant"
    torch.testing.assert_close(derived.tensors[0], dequantized(args[1], "q4k").t(), rtol=0, atol=0)
    assert kquants[0].meta["kquant"].shape == (512, 256)  # blocks along the input dimension
    assert not any(n.target is aten.t.default and n.args[0].name == "w1_1" for n in graph.gm.graph.nodes)
    assert torchnative.stats()["quantized"] == {
        "q4k: quantized": 1,
        "q4k: a matmul weight of shape [96, 8]: q4k needs 2-D, input dimension a multiple of 256": 1}
    (y,) = graph.gm(*args, *derived.tensors)
    (expected,) = f(args[0], dequantized(args[1], "q4k"), args[2], args[3])
    torch.testing.assert_close(y, expected, rtol=1e-5, atol=1e-5)


def test_masked_rows_are_written_out_for_a_plain_softmax_attention():
    """passes.attention.zero_masked_rows: with attention computed as a plain softmax (as IREE and
    Core ML compile it), a query the mask hides from every key is NaN without the pass and 0, as
    eager's kernel gives, with it. (The door records a float mask: SDPA's bool masks become -inf.)"""
    import operator
    import torch.fx as fx
    from torchnative.passes.attention import FLASH, zero_masked_rows

    def plain(q, k, v, *, attn_mask=None):
        scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
        return (scores + attn_mask).softmax(-1) @ v, None

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 3, 4, generator=g) for _ in range(3))
    seen = torch.tensor([[False] * 3, [True, False, True], [True] * 3]).view(1, 1, 3, 3)
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))
    graph = fx.Graph()
    args = [graph.placeholder(n) for n in "qkvm"]
    for a, t in zip(args, (q, k, v, mask)):
        a.meta["val"] = t
    flash = graph.call_function(FLASH, tuple(args[:3]), {"attn_mask": args[3]})
    out = graph.call_function(operator.getitem, (flash, 0))
    out.meta["val"] = q
    graph.output([graph.call_function(torch.ops.aten.mul.Tensor, (out, 2.0))])
    expected = FLASH(q, k, v, attn_mask=mask)[0] * 2
    assert expected[0, :, 0].eq(0).all()

    def run(g: fx.Graph) -> torch.Tensor:
        flash.target = plain
        try:
            return fx.GraphModule(torch.nn.Module(), g)(q, k, v, mask)[0]
        finally:
            flash.target = FLASH
    assert run(graph)[0, :, 0].isnan().all()
    torch.testing.assert_close(run(zero_masked_rows(graph)), expected)

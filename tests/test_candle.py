"""The candle delegate beyond the shared delegate tests: its quantized variants (inexact by design,
checked against float32 with measured bounds), its integer arithmetic, candle panics, expanded outputs."""
import copy

import pytest
import torch
from torch.nn.functional import linear

import torchnative
from torchnative.delegates import REGISTRY
from torchnative.delegates.hf_candle.fold import fold
from torchnative.delegates.hf_candle.interpreter import interpreter
from torchnative.delegates.hf_candle.transfer import to_candle
from tests.conftest import record

pytestmark = pytest.mark.skipif(REGISTRY["candle"].available().status != "executes",
                                reason=REGISTRY["candle"].available().reason)


def _explain(delegate: str, fn, *args):
    """fn's second run under capture: a graph may run on eager until it repeats."""
    for _ in range(2):
        torchnative.reset_stats()
        with torch.no_grad(), torchnative.capture([delegate]):
            e = torchnative.explain(fn, *args)
    return e


@pytest.mark.parametrize("delegate,bound", [("candle-q8_0", 0.03), ("candle-q4k", 0.15)])
def test_quantized_candle_is_close_to_float32(delegate, bound):
    """GGUF weights cost accuracy by design, and candle's quantized matmul also rounds the
    activations to 8 bits. Relative error ‖y_q - y‖/‖y‖ measured on this model (seeds 0-2): q8_0
    0.9-1.1 %, q4k 7.6-8.1 % (4 bits a weight: 15 steps over each 32-weight sub-block's range, 5.7 %
    error on these weights alone). The bounds are about twice that; float32 candle is ~1e-7."""
    model = torch.nn.Sequential(torch.nn.Linear(512, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(4, 512)
    with torch.no_grad():
        ref = model(x)
    e = _explain(delegate, model, x)
    assert e.partitions == [((delegate, 5),)] and not torchnative.stats()["fallbacks"]
    assert 1e-4 < ((e.output - ref).norm() / ref.norm()).item() < bound


def _graph(f, args, roles):
    """f as a Core ATen CapturedGraph whose `param` inputs are baked in."""
    from torch._decomp import core_aten_decompositions
    from torch.fx.experimental.proxy_tensor import make_fx

    from torchnative.ir import CapturedGraph

    gm = make_fx(f, decomposition_table=core_aten_decompositions())(*args)
    names = [n.name for n in gm.graph.nodes if n.op == "placeholder"]
    params = {n: a for n, a, r in zip(names, args, roles) if r == "param"}
    return CapturedGraph(gm, roles, ["output"], params), names


@pytest.mark.parametrize("delegate,quantized,bound", [
    ("candle", {}, 1e-6),
    ("candle-q8_0", {"w1_1": "q8_0", "w2_1": "q8_0", "w3_1": "q8_0"}, 0.03),
    ("candle-q4k", {"w1_1": "q4k", "w2_1": "q4k"}, 0.15),  # w3's 96 inputs do not fill a 256-wide block
])
def test_only_param_matmul_weights_are_quantized(delegate, quantized, bound):
    """Biases, scales and matmuls against runtime tensors (an input, a state) stay float32."""
    def f(x, y, w1, b1, scale, w2, w3):
        return (linear(linear(linear(x, w1, b1) * scale, w2), w3) + x @ y,)

    args = [torch.randn(4, 512), torch.randn(512, 8), torch.randn(256, 512), torch.randn(256), torch.randn(256),
            torch.randn(96, 256), torch.randn(8, 96)]
    graph, names = _graph(f, args, ["input", "state"] + ["param"] * 5)
    d = REGISTRY[delegate]
    artifact = d.compile(graph)
    assert artifact.meta["quantized"] == quantized
    assert set(artifact.meta["fp32_weights"]) == set(names[2:]) - set(quantized)
    (out,), (ref,) = d.load(artifact)(args[:2]), f(*args)
    assert ((out - ref).norm() / ref.norm()).item() < bound


@pytest.mark.parametrize("scheme,bound", [("q8_0", 0.02), ("q4k", 0.03)])
def test_the_quantize_pass_kquants_run_on_candle_and_as_dequantized_weights_elsewhere(scheme, bound):
    """`quantize="q4k"`: the unpinned matmul weights become their k-quants' dequantized values in
    the graph (ONNX Runtime and eager compute exactly eager-with-those-weights) and candle runs the
    same k-quant blocks with its kernels, which also round the activations to 8 bits: measured
    ‖y - y_deq‖/‖y_deq‖ 0.67-0.75 % (q8_0), 0.90-1.03 % (q4k) on seeds 0-2; the bounds are about three times that."""
    from torchnative import events
    from torchnative.passes.quantize import dequantized

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256),
                                torch.nn.GELU(), torch.nn.Linear(256, 64))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        for i in (0, 4):
            reference[i].weight.copy_(dequantized(model[i].weight, scheme))
    x = torch.randn(4, 256)
    with torch.no_grad():
        want = reference(x)
    assert 1e-4 < ((want - model(x)).norm() / want.norm()).item() < 0.2  # the weights are quantized
    for delegate in ("ort", "candle"):
        accelerated = copy.deepcopy(model)
        torchnative.pin(accelerated[2])
        torchnative.accelerate(accelerated, delegates=[delegate], quantize=scheme)
        with record(events.ProgramBuilt) as built, torch.no_grad():
            out = [accelerated(x) for _ in range(3)][-1]
        program = built[-1].program
        kquants = [n for n in program.graph.gm.graph.nodes if "kquant" in n.meta]
        assert [tuple(n.meta["val"].shape) for n in kquants] == [(256, 512), (256, 64)], "model[2] is pinned"
        assert [s.delegate for s in program.steps] == [delegate]
        if delegate == "ort":
            torch.testing.assert_close(out, want, rtol=1e-4, atol=1e-5)
        else:
            assert 1e-4 < ((out - want).norm() / want.norm()).item() < bound
            artifact = REGISTRY["candle"].compile(program.steps[0].graph)
            assert sorted(artifact.meta["quantized"].values()) == [scheme, scheme]


def test_a_candle_panic_is_an_exception_naming_the_op():
    """candle panics raise pyo3's PanicException, a BaseException that `except Exception` (the
    runtime's fallback to eager) misses. q8_1's quantized matmul panics ("no vec-dot"); GGUF files
    cannot hold q8_1, so the runner is built from the weight directly."""
    w = torch.randn(8, 64)
    graph, _ = _graph(lambda x, w: (linear(x, w).relu(),), [torch.randn(2, 64), w], ["input", "param"])
    folded, _ = fold(graph)
    weight = next(n for n in folded if n.op == "call_function")  # w transposed, as mm takes it
    q8_1 = to_candle([w])[0].quantize("q8_1")
    runner = interpreter(graph, {n.name for n in folded}, {weight.name: q8_1}, "candle-q8_1")
    with pytest.raises(RuntimeError, match=r"^candle-q8_1: aten.mm.default \(mm\) failed: PanicException: .*Q8_1"):
        runner([torch.randn(2, 64)])


def test_integer_arithmetic_and_casts_match_eager():
    """int64 add/sub/mul/sum wrap like eager; a cast to bool is "not zero", not candle's truncation."""
    a, b = torch.randint(-2**62, 2**62, (8, 9)), torch.randint(-2**40, 2**40, (9,))
    x = torch.tensor([0.0, 0.5, -3.0, float("nan"), 256.0])

    def f():
        return (a + b) * 3 - (2**40 + 1), a.sum(1), (a * 0 + torch.arange(9) * 128).bool(), (x * 2).bool()

    ref = f()
    e = _explain("candle", f)
    assert all(torch.equal(g, r) for g, r in zip(e.output, ref))
    assert all(d == "candle" for parts in e.partitions for d, _ in parts) and not torchnative.stats()["fallbacks"]


def test_an_expanded_output_keeps_eager_layout():
    """An expand that leaves the candle partition (cumsum runs on eager) has 0 strides in eager;
    the runtime can only copy into the layouts it restrides to when they do not overlap."""
    x = torch.randn(3, 1, 4)

    def f():
        return (x + 1).expand(3, 5, 4).cumsum(1)

    e = _explain("candle", f)
    assert torch.equal(e.output, f())
    assert ("candle", 2) in e.partitions[0] and not torchnative.stats()["fallbacks"]

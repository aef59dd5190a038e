"""Test-time adaptation loops under `accelerate` (issue 22): over 20 steps the outputs, gradients,
parameters, optimizer state and BatchNorm statistics stay eager's; a Python float that changes
every step (DUA's decaying momentum) becomes a scalar input of one graph, not a graph per value;
profiler ranges do not block replay."""
from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative.cache.program_cache import clear_caches, programs

STEPS = 20


def _resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    config = ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5)
    return ResNetForImageClassification(config)


def _images(i: int) -> torch.Tensor:
    return torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(i))


def _batch_norms(model: torch.nn.Module) -> list[torch.nn.BatchNorm2d]:
    return [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]


def _tent_setup(model):
    """TENT: batch statistics only, the BN affine parameters trained by SGD with momentum."""
    model.train().requires_grad_(False)
    params = []
    for bn in _batch_norms(model):
        bn.track_running_stats, bn.running_mean, bn.running_var = False, None, None
        bn.weight.requires_grad_(True), bn.bias.requires_grad_(True)
        params += [bn.weight, bn.bias]
    return model, torch.optim.SGD(params, lr=1e-2, momentum=0.9)


def _tent_step(state, x, i):
    model, opt = state
    logits = model(pixel_values=x).logits
    loss = -(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()
    loss.backward()
    grads = [p.grad.clone() for g in opt.param_groups for p in g["params"]]
    opt.step()
    opt.zero_grad()
    return logits, grads


def _bn_stats_setup(model):
    return model.train()


def _bn_stats_step(model, x, i):
    """Stage 0: re-estimate the BatchNorm statistics on test batches."""
    with torch.no_grad():
        return model(pixel_values=x).logits


def _dua_setup(model):
    model.train()
    return model


def _dua_step(model, x, i):
    """DUA: the momentum decays every step, from 0.1 to a floor."""
    for bn in _batch_norms(model):
        bn.momentum = max(0.1 * 0.94 ** i, 0.005)
    with torch.no_grad():
        return model(pixel_values=x).logits


def _record_function_step(model, x, i):
    with torch.no_grad(), torch.profiler.record_function("adapt"):
        return model(pixel_values=x).logits


@dataclass
class Method:
    name: str
    setup: Callable[[torch.nn.Module], Any]
    step: Callable[[Any, torch.Tensor, int], Any]


METHODS = [
    Method("tent", _tent_setup, _tent_step),
    Method("bn-stats", _bn_stats_setup, _bn_stats_step),
    Method("dua", _dua_setup, _dua_step),
]


def _model_of(state) -> torch.nn.Module:
    return state[0] if isinstance(state, tuple) else state


def _tolerance(delegate: str) -> dict:
    # eager runs the recorded aten ops themselves; ONNX Runtime's kernels round differently, and
    # 20 steps of adaptation carry that on
    return dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-4, atol=1e-4)


def _cases():
    for method in METHODS:
        for delegate in ("eager", "ort"):
            # DUA on ort: test_a_decaying_momentum_is_one_graph_not_one_per_step checks it over 50 steps
            marks = [pytest.mark.slow] if (method.name, delegate) == ("dua", "ort") else []
            yield pytest.param(method, delegate, marks=marks, id=f"{method.name}-{delegate}")


@pytest.mark.parametrize("method,delegate", _cases())
def test_adaptation_steps_match_eager(method, delegate):
    model = _resnet()
    eager = method.setup(copy.deepcopy(model))
    accelerated = method.setup(torchnative.accelerate(copy.deepcopy(model), delegates=[delegate]))
    tol = _tolerance(delegate)
    for i in range(STEPS):
        x = _images(i)
        assert_same(method.step(accelerated, x, i), method.step(eager, x, i), **tol)
    assert_same(dict(_model_of(accelerated).state_dict()), dict(_model_of(eager).state_dict()), **tol)
    if isinstance(eager, tuple):  # the optimizer's momentum buffers
        assert_same([s["momentum_buffer"] for s in accelerated[1].state.values()],
                    [s["momentum_buffer"] for s in eager[1].state.values()], **tol)
    assert torchnative.stats()["graph_runs"] > 0


def test_a_decaying_momentum_is_one_graph_not_one_per_step():
    """DUA's momentum becomes a scalar input after it is seen to change: over 50 steps the calls
    build two graphs (the first call's, the momentum a constant, and the one with it as an input),
    compiled once, where a graph per value compiled none of them. ONNX Runtime runs the whole
    graph: each train-mode BatchNorm decomposed with its momentum a tensor input
    (passes/scalars.py; each one was left to eager before, cutting the graph)."""
    model = _resnet()
    eager = _dua_setup(copy.deepcopy(model))
    accelerated = _dua_setup(torchnative.accelerate(copy.deepcopy(model), delegates=["ort"]))
    clear_caches()
    for i in range(50):
        x = _images(i % 4)
        assert_same(_dua_step(accelerated, x, i), _dua_step(eager, x, i), rtol=1e-4, atol=1e-4)
    graphs = {p.captured.key for p in programs()}
    assert len(graphs) <= 2, len(graphs)
    compiled = [p for p in programs() if any(d != "eager" for d, _ in p.partitions)]
    assert len(compiled) == 1
    scalars = [n for n in compiled[0].graph.placeholders() if type(n.meta["val"]) is float]
    assert len(scalars) == len(_batch_norms(model))  # the momenta; eps stays a constant
    assert [s.delegate for s in compiled[0].steps] == ["ort"], compiled[0].partitions
    assert_same(dict(accelerated.state_dict()), dict(eager.state_dict()), rtol=1e-4, atol=1e-4)


def test_constant_floats_issued_by_one_line_stay_constants():
    """gelu_new multiplies by three different constants in one line of transformers' code: they
    never change, so none is an input, and GPT-2's calls replay."""
    from torchnative import models
    model = models.build("gpt2")
    kw = dict(models.example_inputs("gpt2", model, batch=1, seq=8), use_cache=False)
    torchnative.accelerate(model, delegates=["eager"])
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad():
        for _ in range(4):
            model(**kw)
    assert not [n for p in programs() for n in p.graph.placeholders() if type(n.meta["val"]) is float]
    assert torchnative.stats()["replays"] >= 1


def test_record_function_ranges_do_not_block_replay():
    model = _resnet().eval()
    eager = copy.deepcopy(model)
    torchnative.accelerate(model)
    torchnative.reset_stats()
    for i in range(5):
        x = _images(i)
        assert_same(_record_function_step(model, x, i), _record_function_step(eager, x, i), rtol=1e-4, atol=1e-4)
    s = torchnative.stats()
    assert s["replays"] >= 2 and not s["replay_ineligible"] and not s["syncs"], s


def test_a_whole_step_in_capture_is_one_graph_with_its_backward_and_optimizer_on_ort():
    """Inside `capture`, the step's backward and the optimizer's ops pass the door too: each step is
    one graph (forward, backward, SGD update) compiled once, the forward on ort, convolution_backward
    (no ONNX translation) and batch norm's backward (slower there) on eager, and 20 steps stay eager's."""
    model = _resnet()
    eager, accelerated = _tent_setup(copy.deepcopy(model)), _tent_setup(copy.deepcopy(model))
    clear_caches()
    torchnative.reset_stats()
    for i in range(STEPS):
        x = _images(i)
        with torchnative.capture(["ort"]):
            got = _tent_step(accelerated, x, i)
        assert_same(got, _tent_step(eager, x, i), **_tolerance("ort"))
    assert_same(dict(accelerated[0].state_dict()), dict(eager[0].state_dict()), **_tolerance("ort"))
    assert_same([s["momentum_buffer"] for s in accelerated[1].state.values()],
                [s["momentum_buffer"] for s in eager[1].state.values()], **_tolerance("ort"))
    s = torchnative.stats()
    assert s["graph_runs"] == STEPS and not s["syncs"] and not s["fallbacks"], s
    compiled = [p for p in programs() if any(d == "ort" for d, _ in p.partitions)]
    assert len(compiled) == 1, [p.partitions for p in programs()]
    on = {d: {n.target for st in compiled[0].steps if st.delegate == d for n in st.graph.op_nodes()}
          for d in ("ort", "eager")}
    assert torch.ops.aten.convolution.default in on["ort"]
    assert {torch.ops.aten.convolution_backward.default, torch.ops.aten.native_batch_norm_backward.default} <= on["eager"]
    # SGD's update is in the graph: each BN parameter and its momentum buffer are written by it
    written = sum(r == "state" for r in compiled[0].graph.input_roles)
    assert written == 2 * len(accelerated[1].param_groups[0]["params"]), written

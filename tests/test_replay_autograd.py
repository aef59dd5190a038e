"""Replay of calls autograd records (issue 42): a training-mode forward whose parameters require
grad replays through its program's differentiable form (build/differentiable.py), and gradients,
parameters, BatchNorm statistics and outputs stay eager's: bit for bit on `eager`, within float32
rounding on `ort`, whose partitions then run the forward and the backward."""
from __future__ import annotations

import copy
import operator

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative.cache.program_cache import clear_caches, programs

STEPS = 8


def _tol(delegate: str) -> dict:
    return dict(rtol=0, atol=0) if delegate == "eager" else dict(rtol=1e-4, atol=1e-5)


def _resnet() -> torch.nn.Module:
    from transformers import ResNetConfig, ResNetForImageClassification
    torch.manual_seed(0)
    return ResNetForImageClassification(ResNetConfig(embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1],
                                                     layer_type="basic", num_labels=5))


def _adapting(model: torch.nn.Module):
    """TENT's loss on the BatchNorm affine parameters; the running statistics updated too (train mode)."""
    model.train().requires_grad_(False)
    params = [p for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d) for p in (m.weight, m.bias)]
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.SGD(params, lr=1e-2, momentum=0.9)

    def step(x):
        logits = model(pixel_values=x).logits
        (-(logits.softmax(1) * logits.log_softmax(1)).sum(1).mean()).backward()
        grads = [p.grad.clone() for p in params]
        opt.step()
        opt.zero_grad()
        return logits, grads
    return step


def _differentiated() -> list:
    return [p._differentiable for p in programs() if p._differentiable is not None]


# ort compiling in the call (~17 s) under -m slow: background compiles are what users get
@pytest.mark.parametrize("delegate,background", [("eager", False), pytest.param("ort", False, marks=pytest.mark.slow),
                                                 ("ort", True)])
def test_training_mode_steps_replay_with_eagers_gradients(delegate, background):
    clear_caches()
    proto = _resnet()
    eager_model, accelerated = copy.deepcopy(proto), torchnative.accelerate(
        copy.deepcopy(proto), delegates=[delegate], compile_after=1, background=background)
    eager, adapted = _adapting(eager_model), _adapting(accelerated)
    torchnative.reset_stats()
    for i in range(STEPS):
        x = torch.randn(4, 3, 16, 16, generator=torch.Generator().manual_seed(i % 3))
        assert_same(adapted(x), eager(x), **_tol(delegate))
        if i < 5:  # the forward's program in place (rebuilt with the weights the steps write as inputs),
            torchnative.wait_for_compiles()  # then its differentiable form, made off the calls
    assert_same(dict(accelerated.state_dict()), dict(eager_model.state_dict()), **_tol(delegate))
    stats = torchnative.stats()
    assert stats["replays"] >= STEPS - 5, dict(stats["replay_ineligible"])
    assert _differentiated(), "no program ran its differentiable form"
    if delegate == "ort":  # its forward and backward built for ort, partitions on it
        built = [p for d in _differentiated() for p in d.programs()]
        assert len(built) >= 2 and any(dl == "ort" for p in built for dl, _ in p.partitions)


class _TwoGraphs(torch.nn.Module):
    """A data read between two layers: two graphs, the second fed the first's output."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.a(x).tanh()
        if h.sum() > -100:  # Python reads a value: the graph is cut here
            h = h * 2
        return self.b(h)


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_gradients_flow_through_a_chain_of_graphs_to_inputs_and_weights(delegate):
    eager, accelerated = _TwoGraphs(), torchnative.accelerate(_TwoGraphs(), delegates=[delegate], compile_after=1,
                                                              background=False)
    torchnative.reset_stats()
    for i in range(6):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(i % 2)).requires_grad_(True)
        xe = x.detach().clone().requires_grad_(True)
        got = torch.autograd.grad(accelerated(x).square().sum(), [x, *accelerated.parameters()])
        want = torch.autograd.grad(eager(xe).square().sum(), [xe, *eager.parameters()])
        assert_same(list(got), list(want), **_tol(delegate))
    assert torchnative.stats()["replays"] >= 3


def test_inference_with_grad_on_replays_and_keeps_its_grad_fn():
    """A user who forgot torch.no_grad(): eager's outputs carry a grad_fn, and so do the replays'."""
    model = _TwoGraphs()
    ref = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["eager"])
    torchnative.reset_stats()
    x = torch.randn(4, 6)
    for _ in range(5):
        out = model(x)
        assert out.grad_fn is not None
        assert_same(out, ref(x), rtol=0, atol=0)
    assert torchnative.stats()["replays"] >= 2


def test_a_graph_without_a_backward_goes_on_recording_and_says_why(monkeypatch):
    """Where AOTAutograd cannot make the backward (an op it cannot differentiate), the calls are
    recorded as before, with eager's gradients, and the reason is a fallback in stats()."""
    from torchnative.build import differentiable

    def cannot(self, examples):
        raise NotImplementedError("the derivative for 'some_op' is not implemented")
    monkeypatch.setattr(differentiable.Differentiable, "_prepare", cannot)
    clear_caches()
    eager, accelerated = _TwoGraphs(), torchnative.accelerate(_TwoGraphs(), delegates=["eager"], background=False)
    torchnative.reset_stats()
    for i in range(5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
        got = torch.autograd.grad(accelerated(x).sum(), list(accelerated.parameters()))
        want = torch.autograd.grad(eager(x).sum(), list(eager.parameters()))
        assert_same(list(got), list(want), rtol=0, atol=0)
    stats = torchnative.stats()
    assert stats["replays"] == 0
    assert any("no backward for its graph" in why and "some_op" in why for why in stats["fallbacks"]), stats["fallbacks"]


class Refining(torch.nn.Module):
    """RT-DETR's decoder pattern: each layer refines reference points that the next reads
    detached, so the gradient of a layer's output does not reach the layers before it through them."""

    def __init__(self):
        super().__init__()
        self.layers = torch.nn.ModuleList(torch.nn.Linear(6, 6) for _ in range(3))

    def forward(self, x):
        ref, outs = x, []
        for layer in self.layers:
            new = layer(ref) + ref
            outs.append(new)
            ref = new.detach()
        return torch.stack(outs).square().sum()


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_a_detach_inside_the_forward_stops_the_replays_gradient(delegate):
    torch.manual_seed(0)
    eager = Refining()
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate], compile_after=1, background=False)
    torchnative.reset_stats()
    for step in range(6):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m in (eager, accel):
            m.zero_grad()
            m(x).backward()
        for p, q in zip(eager.parameters(), accel.parameters()):
            assert_same(q.grad, p.grad, **_tol(delegate))
    assert torchnative.stats()["replays"] >= 3, {k: v for k, v in torchnative.stats().items() if v}


class _TwoHeads(torch.nn.Module):
    """ActMAD's pattern: the loss reads one output (features), never the other (logits)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.head = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)

    def forward(self, x):
        h = self.body(x).tanh().sin()  # the backward keeps an intermediate (tanh's): a buffer AOTAutograd may donate
        return h, self.head(h)


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_a_weight_the_loss_does_not_reach_gets_no_gradient_as_in_eager(delegate):
    """The head's weights get no gradient (None, as eager's), so an optimizer with weight decay
    leaves them as they are; a zero gradient would decay them."""
    eager = _TwoHeads()
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate], compile_after=1, background=False)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1) for m in (eager, accel)]
    torchnative.reset_stats()
    for step in range(6):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m, opt in zip((eager, accel), opts):
            features, _ = m(x)
            features.square().mean().backward()
            assert m.head.weight.grad is None and m.body.weight.grad is not None, step
            opt.step()
            opt.zero_grad()
        assert_same(dict(accel.state_dict()), dict(eager.state_dict()), **_tol(delegate))
    assert torchnative.stats()["replays"] >= 3, torchnative.stats()


def _kept_forms() -> list:
    return [f for d in _differentiated() for kept, f in d._forms.items() if kept is not None and f.ready]


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_a_loss_that_reads_one_output_runs_a_backward_of_that_output_alone(delegate):
    """ActMAD's loss reads the features, never the logits: once two backwards got gradients for the
    features alone, replays run a form whose logits are detached (its backward computes no head
    gradients on zeros); a step whose loss reads the logits after all gets eager's gradients
    through the full form run again, and the steps after it too."""
    eager = _TwoHeads()
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate], compile_after=1, background=False)
    clear_caches()
    torchnative.reset_stats()
    for step in range(10):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        both = step in (6, 7)
        for m in (eager, accel):
            features, logits = m(x)
            (features.square().mean() + (logits.sum() if both else 0)).backward()
        for mine, theirs in zip(accel.parameters(), eager.parameters()):
            assert (mine.grad is None) == (theirs.grad is None), step
            if theirs.grad is not None:
                assert_same(mine.grad, theirs.grad, **_tol(delegate))
        for m in (eager, accel):
            m.zero_grad(set_to_none=True)
        if step == 5:
            kept = _kept_forms()
            # the features' output alone (the graph's outputs: features, logits, in its own order)
            assert [len(f.kept) for f in kept] == [1], [(d._given, list(d._forms)) for d in _differentiated()]
    assert torchnative.stats()["replays"] >= 6, torchnative.stats()


def test_a_graph_that_draws_random_numbers_has_no_kept_form():
    """Dropout's mask is drawn in the forward: the full form run again for an unexpected output's
    gradient would draw another, so such a graph keeps its full form. (Random ops cut graphs at
    the door today, so no replayed graph has one; a graph that had one would be held to this.)"""
    from torchnative.build import differentiable
    from torchnative.ir import CapturedGraph

    aten = torch.ops.aten
    g = torch.fx.Graph()
    x, w = g.placeholder("x"), g.placeholder("w")
    h = g.call_function(aten.mm.default, (x, w))
    dropped = g.call_function(aten.native_dropout.default, (h, 0.5, True))
    g.output((g.call_function(operator.getitem, (dropped, 0)), g.call_function(aten.sin.default, (h,))))
    whole = differentiable.Differentiable(CapturedGraph(torch.fx.GraphModule(torch.nn.Module(), g), ["input"] * 2,
                                                        ["output"] * 2), [], None)
    x, w = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True)
    assert whole([x, w]) is not None  # the full form, made in the call (no submit)
    whole.saw(frozenset({0}))
    whole.saw(frozenset({0}))
    assert whole._form([x, w], None) is whole._forms[None] and list(whole._forms) == [None]


@pytest.mark.parametrize("dropout,draws", [(0.0, False), (0.1, True)])
def test_attention_draws_random_numbers_only_with_dropout(dropout, draws):
    """Attention is tagged as drawing for its dropout; RT-DETR's (0) keeps its kept forms."""
    from torchnative.build import differentiable

    g = torch.fx.Graph()
    q = g.placeholder("q")
    node = g.call_function(torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default, (q, q, q, dropout))
    assert differentiable._draws(node) is draws


def test_the_form_of_one_output_saves_less_for_its_backward_than_the_full_one():
    """The kept form's forward returns what the kept output's gradient needs only (the saved
    tensors of the other output's backward are not made), its backward the gradients that output
    reaches only."""
    from torchnative.build import differentiable

    outputs = {}

    def counting(graph, delegates, examples):  # build_program's signature: the graph run as it is
        outputs["backward" if outputs else "forward"] = len(graph.outputs())  # built in this order
        return lambda args: list(graph.gm(*args))
    gm = torch.fx.symbolic_trace(lambda x, w, v: ((x @ w).tanh(), ((x @ w).tanh() @ v).sin()))
    x, w, v = torch.randn(3, 4), torch.randn(4, 4, requires_grad=True), torch.randn(4, 2, requires_grad=True)
    made = {}
    for kept in (None, frozenset({0})):
        outputs.clear()
        form = differentiable._Form(gm, kept, ["a delegate"], counting)
        form.prepare([x, w, v])
        made[kept] = (dict(outputs), len(form.made))
        got = form.run(x, w, v)
        assert_same(list(got), [o.detach() for o in gm(x, w, v)], rtol=0, atol=0)
    kept, full = made[frozenset({0})][0], made[None][0]
    assert kept["forward"] < full["forward"] and kept["backward"] < full["backward"], made  # no gradient for v


def test_a_replay_keeps_its_graph_for_retain_graph_and_frees_it_as_eager_does():
    """Two backwards through one replayed call (the first with retain_graph) give eager's
    gradients; a third fails as eager's does: the replay kept no graph past what eager keeps."""
    eager = _TwoHeads()
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=["eager"], compile_after=1, background=False)
    torchnative.reset_stats()
    for step in range(5):
        x = torch.randn(4, 6, generator=torch.Generator().manual_seed(step))
        for m in (eager, accel):
            features, logits = m(x)
            features.sum().backward(retain_graph=True)
            (features.square().sum() + logits.sum()).backward()
            with pytest.raises(RuntimeError, match="backward through the graph a second time"):
                logits.sum().backward()
        assert_same([p.grad for p in accel.parameters()], [p.grad for p in eager.parameters()], rtol=0, atol=0)
    assert torchnative.stats()["replays"] >= 3, torchnative.stats()


def test_a_backward_whose_program_is_slower_than_its_graph_on_eager_runs_on_eager():
    """The first runs of a built program alternate with its graph on eager, timed; a program slower
    than eager (RT-DETR's backward: ONNX Runtime partitions between eager convolution_backward ops)
    is dropped for eager, said in stats()' fallbacks, with the same values."""
    import time

    from torchnative.build import differentiable

    gm = torch.fx.symbolic_trace(lambda x, w: ((x @ w).tanh(),))  # AOTAutograd's graphs return tuples

    def slow(graph, delegates, examples):  # build_program's signature: a program 10 ms slower than eager
        return lambda args: (time.sleep(0.01), list(graph.gm(*args)))[1]
    built = differentiable._Built(gm, [], slow, "backward")
    x, w = torch.randn(3, 4), torch.randn(4, 2)
    built([x, w])
    built.build()
    torchnative.reset_stats()
    for _ in range(2 * differentiable._TRIALS + 2):
        assert_same(built([x, w])[0], (x @ w).tanh(), rtol=0, atol=0)
    assert built.slower
    assert any("backward's program took" in why for why in torchnative.stats()["fallbacks"]), torchnative.stats()["fallbacks"]

"""Tensors that change at test time: BN statistics (TTA stage 0), adapted parameters (TENT, stage
1), fast weights carried across calls (TTT-Linear), a KV cache; each against the eager loop, and
pinned/state tensors never folded or quantized."""
import copy

import torch

import torchnative
from torchnative import events
from torchnative.passes.quantize import dequantized

DELEGATES = ["ort"]


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
    seen = []
    stop = events.listen(lambda e: seen.append(e) if isinstance(e, events.ProgramBuilt) else None)
    try:
        fn()
    finally:
        stop()
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


def test_tta_stage1_tent_adapts_bn_affine_parameters_like_eager():
    eager = _resnet_classifier()
    accel = copy.deepcopy(eager)
    e_params, e_opt = _tent_setup(eager)
    a_params, a_opt = _tent_setup(accel)
    torchnative.pin(a_params[0])  # one pinned by hand; the others are pinned when they change
    built = []
    stop = events.listen(lambda e: built.append(e.program) if isinstance(e, events.ProgramBuilt) else None)
    try:
        torchnative.accelerate(accel, delegates=DELEGATES)
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
    finally:
        stop()
    assert any(p is a_params[0] for p in torchnative.pinned())
    # no program baked an adapted parameter: each is a float32 input wherever a delegate reads it
    for program in built:
        for _, ref, _ in program.baked:
            assert not any(ref() is p for p in a_params)


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
    built = _programs_built(lambda: [torchnative.accelerate(model, delegates=DELEGATES, quantize="int8")(x)
                                     for _ in range(3)])
    with torch.no_grad():
        torch.testing.assert_close(model(x), reference(x), rtol=1e-4, atol=1e-5)
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

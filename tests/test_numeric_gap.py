"""Compiled partitions against eager: RT-DETR on `ort` equals eager on its compiled calls (its
query selection is a top-k over tied scores), and `explain(..., check=True)` reports each delegate
partition's gap against its own graph run on eager, naming the partition that diverges."""
import copy
import math

import pytest
import torch

import torchnative
from torchnative.delegates import REGISTRY
from torchnative.delegates.eager import delegate as eager
from torchnative.inspector.numeric_gap import gap
from torchnative.interface import YES, Support

pytestmark = pytest.mark.skipif(REGISTRY["ort"].available().status != "executes", reason="needs ort executing here")


def _rt_detr():
    from transformers import RTDetrConfig, RTDetrForObjectDetection, RTDetrResNetConfig

    backbone = RTDetrResNetConfig(embedding_size=16, hidden_sizes=[16, 32, 64, 128], depths=[1, 1, 1, 1],
                                  layer_type="basic", out_features=["stage2", "stage3", "stage4"])
    config = RTDetrConfig(backbone_config=backbone, use_timm_backbone=False, use_pretrained_backbone=False,
                          encoder_in_channels=[32, 64, 128], encoder_hidden_dim=32, encoder_ffn_dim=64,
                          encoder_attention_heads=2, d_model=32, decoder_in_channels=[32, 32, 32], decoder_ffn_dim=64,
                          decoder_attention_heads=2, decoder_layers=2, num_queries=20, num_labels=5)
    return RTDetrForObjectDetection(config).eval()


def test_rt_detr_on_ort_equals_eager_on_compiled_calls():
    # random weights score every anchor alike: the top-k query selection is all ties
    model = _rt_detr()
    pixel_values = torch.randn(1, 3, 128, 128)
    with torch.no_grad():
        reference = model(pixel_values=pixel_values)
        accelerated = torchnative.accelerate(copy.deepcopy(model), delegates=["ort"])
        outs = [accelerated(pixel_values=pixel_values) for _ in range(3)]  # the second is the first compiled
    for out in outs:
        torch.testing.assert_close(out.logits, reference.logits, rtol=0, atol=1e-4)
        torch.testing.assert_close(out.pred_boxes, reference.pred_boxes, rtol=0, atol=1e-4)


@pytest.mark.parametrize("order", [lambda s: torch.topk(s, 20, dim=1).indices,
                                   lambda s: torch.sort(s, dim=1, descending=True).indices],
                         ids=["topk", "sort"])
def test_indices_of_tied_values_equal_eager(order):
    scores = torch.zeros(1, 336)  # RT-DETR's anchors, all scored alike
    fn = lambda s: order(s + 1)  # noqa: E731  (an op before it: a graph of ops, not a lone input)
    with torch.no_grad(), torchnative.capture(["ort"], compile_after=1):
        got = fn(scores)
    assert torch.equal(got, fn(scores))


def test_top_k_values_alone_stay_on_ort():
    # equal values are the same in any order: only a read of the indices is declined
    scores = torch.zeros(1, 336)
    with torch.no_grad():
        e = torchnative.explain(lambda s: torch.topk(s + 1, 20, dim=1).values * 2, scores)
    assert e.partitions == [(("ort", 3),)]


class _PlusOne:
    """Takes relu and returns its result + 1: a delegate that is wrong by exactly 1."""
    name = "plus-one"
    composites = frozenset()

    def available(self):
        return eager.available()

    def supports(self, node):
        return YES if node.target is torch.ops.aten.relu.default else Support(False, "only relu")

    def compile(self, graph):
        return eager.compile(graph)

    def load(self, artifact):
        run = eager.load(artifact)
        return lambda inputs: [o + 1 for o in run(inputs)]


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()


def test_check_reports_a_gap_near_zero_for_each_partition():
    model = _mlp()
    fn = lambda x: model(x).gather(1, torch.topk(model(x), 3, dim=1).indices) * 2  # noqa: E731
    x = torch.randn(4, 16)
    with torch.no_grad():
        e = torchnative.explain(fn, x, check=True)
    steps = [s for s in e.programs[0].steps if s.delegate != "eager"]
    assert [g.delegate for g in e.gaps] == ["ort"] * len(steps) and steps
    for g in e.gaps:
        assert g.runs == 1 and g.max_abs < 1e-5 and not g.diverges, g
        assert sum(k for _, _, k in g.sources) == g.n_ops and g.outputs
    assert f"{len(e.gaps)} delegate partition(s)" in str(e) and "0 diverging" in str(e)


def test_check_names_the_partition_that_diverges(monkeypatch):
    """With the build's own check off (it declines such a partition: tests/test_verify.py), the
    wrong partition runs, and explain(check=True) names it."""
    monkeypatch.setitem(REGISTRY, _PlusOne.name, _PlusOne())
    monkeypatch.setattr("torchnative.build.verify.ENABLED", False)
    model = _mlp()
    x = torch.randn(4, 16)
    with torch.no_grad():
        reference = model(x)
        with torchnative.capture(["plus-one", "ort"], compile_after=1):
            torchnative.explain(model, x)  # builds the program: check=True must watch it from the cache
            e = torchnative.explain(model, x, check=True)
    assert [s.delegate for s in e.programs[0].steps] == ["ort", "plus-one", "ort"]
    ort_before, wrong, ort_after = e.gaps
    assert wrong.delegate == "plus-one" and wrong.diverges
    assert wrong.max_abs == pytest.approx(1.0) and wrong.worst.op == "aten.relu.default"
    # each partition is checked on the inputs it was given: the wrong one's error does not show downstream
    assert ort_before.max_abs < 1e-5 and ort_after.max_abs < 1e-5
    assert (e.output - reference).abs().max() > 0.1  # the model's output is wrong, as the delegate made it
    text = str(e)
    assert "1 diverging" in text and f"DIVERGES {wrong.id}" in text and "aten.relu.default" in text
    # the runners are put back once explain returns: nothing is checked after it
    with torch.no_grad(), torchnative.capture(["plus-one", "ort"], compile_after=1):
        model(x)
    assert wrong.runs == 1


def test_gap_of_values_eager_and_delegate_disagree_on():
    t = torch.tensor
    assert gap(t([1.0, math.inf, math.nan]), t([1.0, math.inf, math.nan])) == (0.0, 0.0)
    assert gap(t([1.0, 2.0]), t([1.0, 4.0])) == (2.0, 0.5)
    assert gap(t([math.nan]), t([1.0]))[0] == math.inf
    assert gap(t([math.inf]), t([-math.inf]))[0] == math.inf
    assert gap(t([1.0, 2.0]), t([1.0])) == (math.inf, math.inf)
    assert gap(t([3]), t([5])) == (2.0, 0.4)  # indices: how far apart

"""The partitioner on hand-built graphs."""
import operator

import torch
import torch.fx as fx

from torchnative.interface import YES, Support
from torchnative.partitioner import partition
from torchnative.partitioner.partition import _IN_PLACE

aten = torch.ops.aten


class Takes:
    """A delegate that supports the ops named."""

    def __init__(self, name, ops):
        self.name, self.ops = name, set(ops)

    def supports(self, node):
        return YES if node.target in self.ops else Support(False, f"{self.name} has no {node.target}")


def _graph(build):
    g = fx.Graph()
    x = g.placeholder("x")
    g.output(build(g, x))
    return g


def _layout(plan):
    return [(p.delegate, [n.name for n in p.nodes]) for p in plan.partitions]


def test_no_cycle_through_an_unsupported_node():
    # a -> b(unsupported) -> c and a -> c: a and c must not merge
    def build(g, x):
        a = g.call_function(aten.relu.default, (x,), name="a")
        b = g.call_function(aten.sin.default, (a,), name="b")
        return g.call_function(aten.add.Tensor, (a, b), name="c")

    plan = partition(_graph(build), [Takes("d", {aten.relu.default, aten.add.Tensor})])
    assert _layout(plan) == [("d", ["a"]), ("eager", ["b"]), ("d", ["c"])]
    assert plan.declined["b"] == [("d", "d has no aten.sin.default")]


def test_unconnected_regions_of_one_delegate_join():
    # c = exp(x) shares no edge with a = relu(x) but joins it: one delegate call instead of two
    def build(g, x):
        a = g.call_function(aten.relu.default, (x,), name="a")
        b = g.call_function(aten.sin.default, (a,), name="b")
        c = g.call_function(aten.exp.default, (x,), name="c")
        return [b, c]

    plan = partition(_graph(build), [Takes("t", {aten.relu.default, aten.exp.default})])
    assert _layout(plan) == [("t", ["a", "c"]), ("eager", ["b"])]


def test_interleaved_delegates_follow_preference_order():
    def build(g, x):
        a = g.call_function(aten.relu.default, (x,), name="a")
        b = g.call_function(aten.cos.default, (a,), name="b")
        c = g.call_function(aten.exp.default, (b,), name="c")
        return g.call_function(aten.neg.default, (c,), name="d")

    first = Takes("first", {aten.relu.default, aten.exp.default})
    second = Takes("second", {aten.relu.default, aten.cos.default, aten.exp.default, aten.neg.default})
    plan = partition(_graph(build), [first, second])
    assert _layout(plan) == [("first", ["a"]), ("second", ["b"]), ("first", ["c"]), ("second", ["d"])]
    plan = partition(_graph(build), [second, first])
    assert _layout(plan) == [("second", ["a", "b", "c", "d"])]


def test_all_supported_is_one_partition_and_empty_graph_has_none():
    def build(g, x):
        a = g.call_function(aten.relu.default, (x,), name="a")
        return g.call_function(aten.relu.default, (a,), name="b")

    everything = Takes("all", {aten.relu.default})
    assert _layout(partition(_graph(build), [everything])) == [("all", ["a", "b"])]
    assert partition(_graph(lambda g, x: x), [everything]).partitions == []


def test_small_regions_go_to_eager_with_a_reason():
    def build(g, x):
        a = g.call_function(aten.relu.default, (x,), name="a")
        b = g.call_function(aten.sin.default, (a,), name="b")
        return g.call_function(aten.relu.default, (b,), name="c")

    plan = partition(_graph(build), [Takes("d", {aten.relu.default})], min_ops=2)
    assert _layout(plan) == [("eager", ["a", "b", "c"])]
    assert "below the minimum of 2" in plan.declined["a"][-1][1]


def test_a_region_of_views_alone_runs_on_eager_without_a_decline():
    """Views are free on eager: a region of them alone declined nothing (explain() said "declined
    1 op(s): its region has 0 op(s)")."""
    def build(g, x):
        a = g.call_function(aten.view.default, (x, [-1]), name="a")
        b = g.call_function(aten.sin.default, (a,), name="b")
        return g.call_function(aten.view.default, (b, [4, 4]), name="c")

    plan = partition(_graph(build), [Takes("d", {aten.view.default})])
    assert _layout(plan) == [("eager", ["a", "b", "c"])]
    assert "a" not in plan.declined and "c" not in plan.declined, plan.declined


def test_getitem_stays_with_its_producer():
    def build(g, x):
        ln = g.call_function(aten.native_layer_norm.default, (x, [4], None, None, 1e-5), name="ln")
        out = g.call_function(operator.getitem, (ln, 0), name="out")
        return g.call_function(aten.sin.default, (out,), name="s")

    plan = partition(_graph(build), [Takes("d", {aten.native_layer_norm.default})])
    assert _layout(plan) == [("d", ["ln", "out"]), ("eager", ["s"])]


def test_partitioning_is_deterministic():
    def build(g, x):
        outs = []
        for i in range(6):
            outs.append(g.call_function(aten.relu.default if i % 2 else aten.sin.default, (x,), name=f"n{i}"))
        return outs

    delegates = [Takes("d", {aten.relu.default})]
    assert _layout(partition(_graph(build), delegates)) == _layout(partition(_graph(build), delegates))


def test_view_only_regions_go_to_eager():
    def build(g, x):
        v = g.call_function(aten.view.default, (x, [-1]), name="v")
        return g.call_function(aten.sin.default, (v,), name="s")

    plan = partition(_graph(build), [Takes("d", {aten.view.default})])
    assert _layout(plan) == [("eager", ["v", "s"])]


def test_a_state_update_goes_only_to_a_delegate_that_writes_in_place():
    # b = index_put_(x, ...) writes the caller's tensor x: a delegate that returns new tensors
    # cannot run it, whatever ops it takes; one that says it writes in place (ort) can
    def build(g, x):
        a = g.call_function(aten.relu.default, (x,), name="a")
        g.call_function(aten.index_put_.default, (x, [None, a], a), name="b")
        return g.call_function(aten.add.Tensor, (a, a), name="c")

    ops = {aten.relu.default, aten.index_put_.default, aten.add.Tensor}
    writer = Takes("writer", ops)
    writer.writes_in_place = True
    plan = partition(_graph(build), [Takes("d", ops)])
    assert _layout(plan) == [("d", ["a", "c"]), ("eager", ["b"])]
    assert plan.declined["b"] == [("d", _IN_PLACE)]
    plan = partition(_graph(build), [Takes("d", ops), writer])
    assert _layout(plan) == [("d", ["a", "c"]), ("writer", ["b"])] and plan.declined["b"] == [("d", _IN_PLACE)]

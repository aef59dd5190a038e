"""State updates written where they are: a KV cache's slice write becomes one in-place primitive.

The recorder functionalizes a write into a real tensor (a StaticCache's `index_copy_`): the graph
computes the tensor's whole new value, which is an output copied back after the run. For a
cache written at a few positions that is two full copies per step (the delegate's output, then
the copy back): 24 of them, 12 MB, in a GPT-2 small decode step. Here such an output becomes
the state update primitive `aten.index_put_(state, indices, values)` on the caller's tensor;
the graph outputs the tensor itself, and the write-back finds nothing to copy. The partitioner
gives the primitive to a delegate that writes the caller's tensor (`writes_in_place`: `ort` binds
its ScatterND's output to the tensor's buffer), else to eager, and a delegate's partition then
hands out only the written values.
"""
from __future__ import annotations

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph

SLICE_UPDATE = torch.ops.aten.index_put_.default
WHOLE_UPDATE = torch.ops.aten.copy_.default
_INDEX_PUT = torch.ops.aten.index_put.default


def slice_updates(graph: CapturedGraph) -> CapturedGraph:
    """Rewrite each state output `index_put(s, indices, values)` of its own state input `s` into
    `index_put_(s, indices, values)` when nothing else reads `s`: the order of the write and that
    functional index_put (whose value the graph may still use) then does not matter. Outputs
    that were that new value are `s`."""
    g = graph.gm.graph
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    values = list(out.args[0])
    first = len(values) - len(graph.writes)
    changed = False
    for k, i in enumerate(graph.writes):
        new, state = values[first + k], placeholders[i]
        if not (new.target is _INDEX_PUT and new.args[0] is state and set(state.users) == {new}
                and not (new.args[3] if len(new.args) > 3 else new.kwargs.get("accumulate", False))):
            continue
        with g.inserting_before(out):
            write = g.call_function(SLICE_UPDATE, (state, *new.args[1:3]))
        write.meta = {**new.meta, "val": state.meta["val"]}
        # a value Python still holds (the tensor an in-place op returned) is, in eager, the
        # written tensor itself
        values = [state if v is new else v for v in values[:first + k]] + [state] + values[first + k + 1:]
        changed = True
    if changed:
        out.args = (values,)
        g.eliminate_dead_code()  # fx keeps the in-place op: its schema is mutable
        graph.gm.recompile()
    return graph


def whole_writes(graph: CapturedGraph) -> CapturedGraph:
    """A partition's inputs it computes the whole new value of (a fast weight's W - lr·∇), which
    nothing outside it reads the old value of (`written_into`), written at its end by
    `aten.copy_(input, new)`: for a delegate whose program keeps them as its states (Core AI).
    Every reader of the old value comes before the write; the outputs that were the new value are
    the written input. A copy: the partition's graph stays as built, for eager to run."""
    pairs = graph.written_into
    if not pairs:
        return graph
    graph = graph.copy()
    g = graph.gm.graph
    out, placeholders = graph.output_node(), graph.placeholders()
    values = list(out.args[0])
    for o, p in pairs:
        if any(v is placeholders[p] for v in values):  # the old value is an output too: it must stay
            continue
        new = values[o]
        with g.inserting_before(out):
            write = g.call_function(WHOLE_UPDATE, (placeholders[p], new))
        write.meta = {**new.meta, "val": placeholders[p].meta["val"]}
        values = [write if v is new else v for v in values]
    out.args = (values,)
    graph.gm.recompile()
    return graph


def written_states(graph: CapturedGraph) -> list[str]:
    """Names of the placeholders the graph writes in place (a KV cache, a fast weight), in order."""
    return list(dict.fromkeys(n.args[0].name for n in graph.gm.graph.nodes
                              if n.target is SLICE_UPDATE or n.target is WHOLE_UPDATE and n.args[0].op == "placeholder"))


def state_of(n: fx.Node) -> str | None:
    """The state a graph output is: the placeholder itself or its in-place write."""
    while n.target in (SLICE_UPDATE, WHOLE_UPDATE):
        n = n.args[0]
    return n.name if n.op == "placeholder" else None

"""Common-subexpression elimination and dead-code elimination."""
from __future__ import annotations

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph
from torchnative.sizes import SIZES


def pure(n: fx.Node) -> bool:
    target = n.target
    if not isinstance(target, torch._ops.OpOverload):
        return n.op == "call_function"  # operator.getitem on a multi-output op
    return not target._schema.is_mutable and torch.Tag.nondeterministic_seeded not in target.tags


def cse(graph: CapturedGraph) -> CapturedGraph:
    """Replace each pure op that repeats an earlier one (same op, same arguments) by that one."""
    seen: dict = {}
    g = graph.gm.graph
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    escaping = set(out.all_input_nodes)  # two outputs must stay two tensors: one may be written
    for n in list(g.nodes):
        if n.op != "call_function" or not pure(n):
            continue
        # two ops alike at this size may follow other rules at another (torchnative.sizes)
        key = (n.target, repr(n.args), repr(sorted(n.kwargs.items())), repr(n.meta.get(SIZES)))
        first = seen.setdefault(key, n)
        if first is not n and not (n in escaping and first in escaping):
            n.replace_all_uses_with(first)
            g.erase_node(n)
    return dce(graph)


def undetach(graph: CapturedGraph) -> CapturedGraph:
    """`detach` as `alias`: a program's graph runs without autograd (a differentiable replay
    differentiates the captured graph, where detach stays), and delegates know alias."""
    for n in graph.gm.graph.find_nodes(op="call_function", target=torch.ops.aten.detach.default):
        n.target = torch.ops.aten.alias.default
    return graph


def hoist_placeholders(graph: CapturedGraph) -> CapturedGraph:
    """Move every placeholder, in order, before the first op (capture interleaves them), so a
    pass can add inputs after the last one and ops right after those."""
    nodes = list(graph.gm.graph.nodes)
    first_op = next((n for n in nodes if n.op != "placeholder"), None)
    if first_op is not None:
        for n in nodes[nodes.index(first_op):]:
            if n.op == "placeholder":
                first_op.prepend(n)
    return graph


def dce(graph: CapturedGraph) -> CapturedGraph:
    """Drop ops whose values nothing uses (placeholders stay: they are the calling convention)."""
    graph.gm.graph.eliminate_dead_code()
    graph.gm.recompile()
    return graph

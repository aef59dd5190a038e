"""Constant folding: what `param` and `constant` inputs alone determine (a RoPE table from its
inverse frequencies, a scaled weight, a mask built from `arange`) is computed once, when the
program is built, and enters the graph as a `constant` input; a bias that is all zeros is dropped.
`pinned` and `state` inputs change at test time, so nothing that reads them is folded."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torchnative import events
from torchnative.ir import CapturedGraph, is_weight
from torchnative.passes.cleanup import dce, pure
from torchnative.passes.derived import Derived, add_constant
from torchnative.sizes import SIZES

# a folded value may be larger than what it is computed from (a mask from `arange`), up to this
_GROWTH = 1 << 20  # bytes


def _bytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def _foldable(n: fx.Node, known: dict[fx.Node, set[int]]) -> bool:
    if n.op != "call_function" or not pure(n) or SIZES in n.meta:  # a value whose size varies is no constant
        return False
    if not isinstance(n.target, torch._ops.OpOverload) and n.target is not operator.getitem:
        return False
    return all(a in known for a in n.all_input_nodes)


def _free(n: fx.Node) -> bool:
    """A view of a view … of an input: folding it saves nothing, and quantization and delegates
    recognise a weight through its views."""
    while n.op == "call_function":
        if not getattr(n.target, "is_view", False):
            return False
        n = n.args[0]
    return True


def fold_constants(graph: CapturedGraph, inputs: list[torch.Tensor], derived: Derived) -> CapturedGraph:
    """Replace each value that weights alone determine, and that a runtime op reads, by a constant
    input computed now. `derived.sources` gains the weights it came from: a change to one of them
    makes the program stale."""
    g = graph.gm.graph
    known: dict[fx.Node, set[int]] = {}  # foldable node -> indices of the inputs it derives from
    for i, (p, role) in enumerate(zip(graph.placeholders(), graph.input_roles)):
        if is_weight(role):
            known[p] = {i}
    for n in g.nodes:
        if _foldable(n, known):
            known[n] = set().union(*(known[a] for a in n.all_input_nodes))
    out = next(n for n in reversed(g.nodes) if n.op == "output")
    frontier = [n for n in known if n.op == "call_function" and not _free(n) and n not in out.all_input_nodes
                and any(u not in known for u in n.users)]
    if not frontier:
        return graph
    values = _evaluate(graph, inputs, frontier)
    folded = 0
    for n in frontier:
        value = values[n]
        read = sum(_bytes(inputs[i]) for i in known[n])
        if not isinstance(value, torch.Tensor) or _bytes(value) > max(read, _GROWTH):
            continue
        p = add_constant(graph, n, f"{n.name}_folded")
        n.replace_all_uses_with(p)
        derived.tensors.append(value)
        derived.sources |= known[n]
        folded += 1
    events.STATS.folded += folded
    return dce(graph) if folded else graph


def drop_zero_biases(graph: CapturedGraph, inputs: list[torch.Tensor], derived: Derived) -> CapturedGraph:
    """`addmm(b, x, w)` whose bias `b` is a weight of zeros becomes `mm(x, w)`: one add less per
    element of the output (a Gemm that writes its bias into the output, then accumulates onto it).
    Freshly initialised models have zero biases (transformers' `_init_weights`), and
    torch.onnx.export's optimizer drops them the same way. The bias becomes a source of the
    program, which a change to it makes stale."""
    index = dict(zip(graph.placeholders(), range(len(inputs))))
    g = graph.gm.graph
    dropped = 0
    for n in list(g.find_nodes(op="call_function", target=torch.ops.aten.addmm.default)):
        bias = n.args[0]
        i = index.get(bias)
        if i is None or not is_weight(graph.input_roles[i]) or n.kwargs.get("alpha", 1) != 1:
            continue
        if inputs[i].any():
            continue
        with g.inserting_before(n):
            mm = g.call_function(torch.ops.aten.mm.default, n.args[1:3])
        mm.meta = dict(n.meta)
        n.replace_all_uses_with(mm)
        g.erase_node(n)
        derived.sources.add(i)
        dropped += 1
    events.STATS.folded += dropped
    return dce(graph) if dropped else graph


def _evaluate(graph: CapturedGraph, inputs: list[torch.Tensor], wanted: list[fx.Node]) -> dict[fx.Node, object]:
    """Eager values of `wanted`, computing only what they need."""
    env: dict[fx.Node, object] = dict(zip(graph.placeholders(), inputs))

    def value(n: fx.Node):
        if n not in env:
            args, kwargs = fx.map_arg((n.args, n.kwargs), value)
            env[n] = n.target(*args, **kwargs)
        return env[n]

    with torch.no_grad():  # autograd records above the door, on the lazy tensors; these are values
        return {n: value(n) for n in wanted}

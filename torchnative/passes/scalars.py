"""Scalar graph inputs as 0-d tensors, for a delegate whose compiled graphs take tensors only
(ONNX Runtime). A Python float that changes between calls is an input of the graph
(recording/scalars.py: DUA's BatchNorm momentum, passed as `mul_(1 - m)` and `add_(..., alpha=m)`);
a delegate that compiled it in as a constant would be built again for every value, and one that
declines it leaves eager every op reading it (RT-DETR's 168 such ops cut its graph into 115
partitions). Here the input is a float64 0-d tensor, cast to the dtype each reader computes in, as
eager's kernels cast a Python scalar (a float32 op computes with float(m)); `add(x, y, alpha=s)`
becomes `add(x, mul(y, s))`, one rounding more than eager's fused kernel."""
from __future__ import annotations

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph

aten = torch.ops.aten
_ALPHA = frozenset({aten.add.Tensor, aten.sub.Tensor})  # ops whose `alpha` multiplies their second tensor
# (x, weight, bias, running_mean, running_var, training, momentum, eps): the momentum, a float in
# the schema, moves the running statistics; torch's decomposition reads it as a tensor would be read
_BATCH_NORM_TRAINING = frozenset({aten._native_batch_norm_legit_functional.default})


def is_scalar(n: fx.Node) -> bool:
    """A scalar input of the graph: a placeholder whose value is a Python float."""
    return n.op == "placeholder" and type(n.meta.get("val")) is float


def placed(node: fx.Node) -> bool:
    """Does every scalar input `node` reads sit where a tensor can (an argument its schema types
    Tensor, add/sub's `alpha`, or the momentum of a train-mode batch norm, which `as_tensors`
    decomposes)?"""
    if _momentum_read(node):
        return True
    schema = getattr(node.target, "_schema", None)
    if schema is None or not isinstance(node.meta.get("val"), torch.Tensor):
        return False
    by_name = {a.name: a for a in schema.arguments}
    read = [(schema.arguments[i] if i < len(schema.arguments) else None, a) for i, a in enumerate(node.args)]
    read += [(by_name.get(k), a) for k, a in node.kwargs.items()]
    for arg, value in read:
        if isinstance(value, fx.Node) and is_scalar(value):
            alpha = arg is not None and arg.name == "alpha" and node.target in _ALPHA and isinstance(node.args[1], fx.Node)
            if arg is None or not (isinstance(arg.type, torch.TensorType) or alpha):
                return False
    return True


def as_tensors(graph: CapturedGraph) -> tuple[CapturedGraph, list[int]]:
    """The graph with its scalar inputs as float64 0-d tensors (every reader `placed`), and their
    positions among its placeholders (the runner makes each call's float a tensor there)."""
    positions = [k for k, p in enumerate(graph.placeholders()) if is_scalar(p)]
    if not positions:
        return graph, []
    graph = graph.copy()
    g = graph.gm.graph
    for node in [n for n in g.nodes if _momentum_read(n)]:
        _decompose_batch_norm(g, node)
    for k in positions:
        p = graph.placeholders()[k]
        p.meta["val"] = torch.empty((), dtype=torch.float64, device="meta")
        for user in list(p.users):
            _read_as_tensor(g, p, user)
    graph.gm.recompile()
    return graph, positions


def _read_as_tensor(g: fx.Graph, p: fx.Node, user: fx.Node) -> None:
    dtype = user.meta["val"].dtype
    with g.inserting_before(user):
        cast = g.call_function(aten._to_copy.default, (p,), {"dtype": dtype})
        cast.meta["val"] = torch.empty((), dtype=dtype, device="meta")
        if user.kwargs.get("alpha") is p:
            scaled = g.call_function(aten.mul.Tensor, (user.args[1], cast))
            scaled.meta["val"] = aten.mul.Tensor(user.args[1].meta["val"], cast.meta["val"])
            user.args = (user.args[0], scaled)
            user.kwargs = {k: v for k, v in user.kwargs.items() if k != "alpha"}
    user.replace_input_with(p, cast)


def _momentum_read(node: fx.Node) -> bool:
    """Is `node` a train-mode batch norm (with its weights and statistics) whose only scalar
    input is its momentum?"""
    return node.target in _BATCH_NORM_TRAINING and is_scalar(node.args[6]) and \
        all(isinstance(a, fx.Node) and not is_scalar(a) for a in node.args[:5])


def _decompose_batch_norm(g: fx.Graph, node: fx.Node) -> None:
    """`node` replaced by torch's decomposition of it (the one ONNX export uses for train-mode
    batch norm anyway), its momentum a 0-d tensor there: then a float input the graph reads."""
    from torch._decomp.decompositions import native_batch_norm_helper
    from torch.fx.experimental.proxy_tensor import make_fx

    x, weight, bias, mean, var, _, momentum, eps = node.args
    tensors = [x, weight, bias, mean, var]

    def decomposed(*values):
        return native_batch_norm_helper(*values[:5], True, values[5], eps, functional=True)

    examples = [torch.empty_like(t.meta["val"], device="meta") for t in tensors]
    traced = make_fx(decomposed)(*examples, torch.empty((), dtype=x.meta["val"].dtype, device="meta"))
    env = dict(zip([p for p in traced.graph.nodes if p.op == "placeholder"], [*tensors, momentum]))
    with g.inserting_before(node):
        for n in traced.graph.nodes:
            if n.op == "call_function":
                env[n] = g.node_copy(n, lambda a: env[a])
            elif n.op == "output":
                results = [env[o] if isinstance(o, fx.Node) else o for o in n.args[0]]
    for user in list(node.users):  # getitem(node, i) nodes
        user.replace_all_uses_with(results[user.args[1]])
        g.erase_node(user)
    g.erase_node(node)

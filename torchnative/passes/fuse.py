"""Fusion into named composites: a pattern of Core ATen ops that a delegate maps to one fused
kernel (ONNX Runtime's RMSNormalization and RotaryEmbedding; a tanh GELU for a delegate that has
one; Core AI's gated delta update, a fast-weight recurrence with two results) becomes one node.

Fusion runs on a delegate's partition just before it is lowered, with the composites that delegate
names (`Delegate.composites`): a partition that eager runs keeps the ops as recorded, so its
results stay eager's bit for bit. Each composite's eager implementation is its pattern, op for op,
so a fused graph run eagerly equals the unfused one exactly (the tests hold the matchers to that).
Scaled-dot-product attention needs no fusion here: the door records it as one node.
"""
from __future__ import annotations

import math
import operator
from collections import Counter
from dataclasses import dataclass
from typing import Callable, Iterable

import torch
import torch.fx as fx

from torchnative import events
from torchnative.ir import HALVES, CapturedGraph
from torchnative.passes.cleanup import dce

aten = torch.ops.aten


@torch.library.custom_op("torchnative::rms_norm", mutates_args=())
def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """weight · x / √(mean(x², last dim) + eps), in the op order of transformers' RMSNorm."""
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


@rms_norm.register_fake
def _(x, weight, eps):
    return torch.empty_like(x)


@torch.library.custom_op("torchnative::rope", mutates_args=())
def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding, rotate-half form: x·cos + [-x₂, x₁]·sin over the last dim.
    The fusion proves that cos and sin repeat their first half (transformers builds them from
    cat([freqs, freqs])): a fused kernel reads that half alone."""
    h = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., h:], x[..., :h]], -1) * sin


@rope.register_fake
def _(x, cos, sin):
    return torch.empty_like(x)


@torch.library.custom_op("torchnative::gelu_tanh", mutates_args=())
def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    """GELU's tanh approximation in the op order of transformers' NewGELUActivation (GPT-2);
    aten.gelu(approximate="tanh") rounds differently."""
    return x * 0.5 * (1.0 + torch.tanh(math.sqrt(2 / math.pi) * (x + torch.pow(x, 3.0) * 0.044715)))


@gelu_tanh.register_fake
def _(x):
    return torch.empty_like(x)


@torch.library.custom_op("torchnative::quantized_mm", mutates_args=())
def quantized_mm(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, bits: int) -> torch.Tensor:
    """x @ wᵀ (+ bias) with w = q · scale, q's `bits`-bit integers in groups along w's input
    dimension ([out, groups, group] int8, scale [out, groups, 1]): passes.quantize's dequantized
    weight as a linear layer reads it, in the ops it was recorded as."""
    w = (q.to(torch.float32) * scale).view(q.shape[0], -1).t()
    return torch.mm(x, w) if bias is None else torch.addmm(bias, x, w)


@quantized_mm.register_fake
def _(x, q, scale, bias, bits):
    return x.new_empty(x.shape[0], q.shape[0])


@torch.library.custom_op("torchnative::delta_rule", mutates_args=())
def delta_rule(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
               beta: torch.Tensor, index: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Token `index` of the gated delta rule (Gated DeltaNet's fast-weight recurrence, as
    transformers' torch_recurrent_gated_delta_rule writes it) over a state S [b, h, dk, dv]:
    S ← S·exp(g); S ← S + k ⊗ β(v − Sᵀk); the token's output Sᵀ(q / scale). q, k [b, h, s, dk],
    v [b, h, s, dv], g and β [b, h, s]: the sequences the step selects its token from. Returns
    (output [b, h, dv], new S), in eager's op order."""
    q_t, k_t, v_t = q.select(2, index) / scale, k.select(2, index), v.select(2, index)
    s = state * g.select(2, index).exp().unsqueeze(-1).unsqueeze(-1)
    ku = k_t.unsqueeze(-1)
    delta = (v_t - (s * ku).sum(-2)) * beta.select(2, index).unsqueeze(-1)
    s = s + ku * delta.unsqueeze(-2)
    return (s * q_t.unsqueeze(-1)).sum(-2), s


@delta_rule.register_fake
def _(state, q, k, v, g, beta, index, scale):
    return v.new_empty(v.shape[0], v.shape[1], v.shape[3]), torch.empty_like(state)


# ---- patterns: (op, *args[, {kwargs}]) tuples; "$name" binds a node or a value, a repeated name must agree

_COMMUTATIVE = {aten.add.Tensor, aten.mul.Tensor}


def _match(pattern, arg, env: dict) -> bool:
    if isinstance(pattern, str) and pattern.startswith("$"):
        if pattern in env:
            return env[pattern] is arg or (not isinstance(arg, fx.Node) and env[pattern] == arg)
        env[pattern] = arg
        return True
    if isinstance(pattern, tuple):
        kwargs = pattern[-1] if isinstance(pattern[-1], dict) else {}
        if not isinstance(arg, fx.Node) or arg.target != pattern[0] or arg.kwargs != kwargs:
            return False
        pattern = pattern[:-1] if kwargs else pattern
        orders = [pattern[1:]]
        if pattern[0] in _COMMUTATIVE:
            orders.append(pattern[1:][::-1])
        for args in orders:
            trial = dict(env)
            if len(args) == len(arg.args) and all(_match(p, a, trial) for p, a in zip(args, arg.args)):
                env.clear()
                env.update(trial)
                return True
        return False
    if isinstance(pattern, list):
        return isinstance(arg, (list, tuple)) and len(pattern) == len(arg) and \
            all(_match(p, a, env) for p, a in zip(pattern, arg))
    return pattern == arg and not isinstance(arg, fx.Node)  # constants exactly: the composite computes with its own


def _inside(root: fx.Node, leaves: set) -> set:
    """The nodes of a match: its root and what is below it down to its bound inputs."""
    inside, stack = {root}, list(root.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in inside and n not in leaves:
            inside.add(n)
            stack.extend(n.all_input_nodes)
    return inside


def _self_contained(inside: set, results: tuple) -> bool:
    """Is every node of the match used inside it alone, but the composite's results? Else fusing
    would compute that value twice."""
    return all(u in inside for n in inside - set(results) for u in n.users)


def _last(dim: int, rank: int) -> bool:
    return dim in (-1, rank - 1)


def _val(n) -> torch.Tensor | None:
    v = n.meta.get("val") if isinstance(n, fx.Node) else None
    return v if isinstance(v, torch.Tensor) else None


_RMS = (aten.mul.Tensor, "$w", (aten.mul.Tensor, "$x", (aten.rsqrt.default, (aten.add.Tensor, (
    aten.mean.dim, (aten.pow.Tensor_Scalar, "$x", 2), [-1], True), "$eps"))))


def _rms_norm(env: dict):
    x, w, eps = env["$x"], env["$w"], env["$eps"]
    xv, wv = _val(x), _val(w)
    if xv is None or wv is None or not isinstance(eps, float) or xv.dim() == 0 or wv.shape != xv.shape[-1:]:
        return None
    return rms_norm_op, (x, w, eps)


_GELU = (aten.mul.Tensor, (aten.mul.Tensor, "$x", 0.5), (aten.add.Tensor, (aten.tanh.default, (
    aten.mul.Tensor, (aten.add.Tensor, "$x", (aten.mul.Tensor, (aten.pow.Tensor_Scalar, "$x", 3.0), 0.044715)),
    math.sqrt(2 / math.pi))), 1.0))


def _gelu(env: dict):
    return gelu_tanh_op, (env["$x"],)


_ROPE = (aten.add.Tensor, (aten.mul.Tensor, "$x", "$cos"), (aten.mul.Tensor, (aten.cat.default, [
    (aten.neg.default, (aten.slice.Tensor, "$x", "$d1", "$h", "$end")), (aten.slice.Tensor, "$x", "$d0", 0, "$h")],
    "$dc"), "$sin"))
# elementwise ops that keep "the last dim repeats its first half" (with scalar other operands)
_KEEPS_HALVES = {aten.cos.default, aten.sin.default, aten.mul.Tensor, aten.div.Tensor, aten._to_copy.default,
                 aten.unsqueeze.default, aten.clone.default}


def _repeats_halves(n: fx.Node) -> bool:
    """Is n's last dim [a, a] by construction: cat([a, a], -1), or elementwise ops with scalar
    operands over such a value?"""
    if n.target is aten.cat.default:
        parts, dim = n.args[0], n.args[1] if len(n.args) > 1 else 0
        return len(parts) == 2 and parts[0] is parts[1] and _last(dim, n.meta["val"].dim())
    if n.target not in _KEEPS_HALVES or any(isinstance(a, fx.Node) for a in n.args[1:]):
        return False
    if n.target is aten.unsqueeze.default and _last(n.args[1], n.meta["val"].dim()):
        return False
    return n.args[0].meta.get(HALVES, False)


def mark_halves(graph: CapturedGraph) -> CapturedGraph:
    """Mark the values whose last dim repeats its first half (meta[HALVES]), on the whole graph:
    a partition that reads cos and sin from another one still knows it."""
    for n in graph.gm.graph.nodes:
        if n.op == "call_function" and _repeats_halves(n):
            n.meta[HALVES] = True
    return graph


def _rope(env: dict):
    x, cos, sin = env["$x"], env["$cos"], env["$sin"]
    xv, cv, sv = _val(x), _val(cos), _val(sin)
    if xv is None or cv is None or sv is None or xv.dim() != 4 or cv.dim() != 4 or sv.shape != cv.shape:
        return None
    d = xv.shape[-1]
    if not (d % 2 == 0 and env["$h"] * 2 == d and env["$end"] >= d and cv.shape[-1] == d and cv.shape[1] == 1
            and all(_last(env[k], 4) for k in ("$d0", "$d1", "$dc"))):
        return None
    if not (cos.meta.get(HALVES) and sin.meta.get(HALVES)):
        return None
    return rope_op, (x, cos, sin)


# a weight passes.quantize made low-bit, dequantized, as a linear layer (or Conv1D) reads it
_DEQUANTIZED = (aten.permute.default, (aten.view.default, (aten.mul.Tensor, (
    aten._to_copy.default, "$q", {"dtype": torch.float32}), "$scale"), "$shape"), [1, 0])
_QUANTIZED_MM = (aten.mm.default, "$x", _DEQUANTIZED)
_QUANTIZED_ADDMM = (aten.addmm.default, "$bias", "$x", _DEQUANTIZED)
BITS = {"int8": 8, "int4": 4}


def _quantized_mm(env: dict):
    q, scale, x, bias = env["$q"], env["$scale"], env["$x"], env.get("$bias")
    qv, sv, xv, bv = _val(q), _val(scale), _val(x), _val(bias)
    scheme = q.meta.get("quantized") if isinstance(q, fx.Node) else None
    if scheme not in BITS or qv is None or sv is None or xv is None or qv.dtype != torch.int8 or qv.dim() != 3:
        return None
    n, groups, group = qv.shape
    if sv.shape != (n, groups, 1) or sv.dtype != torch.float32 or xv.dim() != 2 or xv.dtype != torch.float32 \
            or xv.shape[1] != groups * group or env["$shape"] != [n, groups * group]:
        return None
    if bias is not None and (bv is None or bv.dtype != torch.float32 or bv.shape != (n,)):
        return None
    return quantized_mm_op, (x, q, scale, bias, BITS[scheme])


# one token of a gated delta rule: its output (the root) read from the new state, which is the
# composite's second result; each value of the token picked by one select of its sequence
_READOUT = (aten.sum.dim_IntList, (aten.mul.Tensor, "$s2", (aten.unsqueeze.default, (
    aten.select.int, "$qs", "$sd", "$i"), "$u1")), "$r1")
_UPDATED = (aten.add.Tensor, "$s1", (aten.mul.Tensor, "$ku", (aten.unsqueeze.default, (aten.mul.Tensor, (
    aten.sub.Tensor, (aten.select.int, "$v", "$sd", "$i"), (aten.sum.dim_IntList, (aten.mul.Tensor, "$s1", "$ku"), "$r2")),
    (aten.unsqueeze.default, (aten.select.int, "$beta", "$sd", "$i"), "$u2")), "$u3")))
_DECAYED = (aten.mul.Tensor, "$state", (aten.unsqueeze.default, (aten.unsqueeze.default, (
    aten.exp.default, (aten.select.int, "$g", "$sd", "$i")), "$u4"), "$u5"))
_KEY = (aten.unsqueeze.default, (aten.select.int, "$k", "$sd", "$i"), "$u6")


def _delta_rule(env: dict):
    s2 = env["$s2"]
    if not (_match(_UPDATED, s2, env) and _match(_DECAYED, env["$s1"], env) and _match(_KEY, env["$ku"], env)):
        return None
    qs, state, k, v, g, beta = (env[n] for n in ("$qs", "$state", "$k", "$v", "$g", "$beta"))
    # the query divided by √dk before its token is picked (Core AI's composite scales it so itself)
    if not (isinstance(qs, fx.Node) and qs.target is aten.div.Tensor and isinstance(qs.args[1], float)):
        return None
    q, scale = qs.args
    vals = [_val(x) for x in (state, q, k, v, g, beta)]
    if any(x is None or x.dtype != torch.float32 for x in vals) or env["$sd"] != 2:
        return None
    sv, qv, kv, vv, gv, bv = vals
    if sv.dim() != 4 or qv.dim() != 4:
        return None
    b, h, dk, dv = sv.shape
    n = qv.shape[2]
    if not (qv.shape == kv.shape == (b, h, n, dk) and vv.shape == (b, h, n, dv) and gv.shape == bv.shape == (b, h, n)
            and scale == dk ** 0.5 and env["$r1"] in ([-2], [2]) and env["$r2"] in ([-2], [2])):
        return None
    # each unsqueeze where eager's broadcasting needs it: g and β by two and one trailing dims, k and q
    # as columns, the token's correction as a row
    dims = {"$u1": (3, -1), "$u2": (2, -1), "$u3": (2, -2), "$u4": (2, -1), "$u5": (3, -1), "$u6": (3, -1)}
    if any(env[u] not in allowed for u, allowed in dims.items()):
        return None
    for inner in ("$s1", "$ku", "$s2"):  # what is left bound are the leaves
        env.pop(inner)
    return delta_rule_op, (state, q, k, v, g, beta, env["$i"], scale), (s2,)


rms_norm_op = torch.ops.torchnative.rms_norm.default
quantized_mm_op = torch.ops.torchnative.quantized_mm.default
rope_op = torch.ops.torchnative.rope.default
gelu_tanh_op = torch.ops.torchnative.gelu_tanh.default
delta_rule_op = torch.ops.torchnative.delta_rule.default


@dataclass(frozen=True)
class Composite:
    pattern: tuple
    # bound pattern → (op, args[, other results]), or None when the match does not qualify; other
    # results: the nodes of the match the op's results 1.. replace (the root is result 0)
    build: Callable[[dict], tuple | None]
    dtypes: frozenset  # what its fused kernel computes in: every tensor operand has one of them, the same
    # shaped and typed like its first operand, its operands of one dtype (build checks the others')
    like_first: bool = True
    # its inner values read by no one else (else they would be computed twice); a dequantized
    # weight that an embedding reads too (tied) is computed for it alone, once, at load
    exclusive: bool = True


# ONNX's type constraints: RMSNormalization and Gelu take float16/32/64 and bfloat16, RotaryEmbedding
# no float64 (ONNX Runtime rejects the model)
_FLOATS = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})

# the composites by the name delegates ask for them
COMPOSITES: dict[str, Composite] = {
    "rms_norm": Composite(_RMS, _rms_norm, _FLOATS),
    "rope": Composite(_ROPE, _rope, _FLOATS - {torch.float64}),
    "gelu_tanh": Composite(_GELU, _gelu, _FLOATS),
    "quantized_mm": Composite(_QUANTIZED_MM, _quantized_mm, frozenset({torch.float32}), like_first=False, exclusive=False),
    "quantized_addmm": Composite(_QUANTIZED_ADDMM, _quantized_mm, frozenset({torch.float32}), like_first=False,
                                 exclusive=False),
    "delta_rule": Composite(_READOUT, _delta_rule, frozenset({torch.float32}), like_first=False),
}


def _qualifies(root: fx.Node, args: tuple, c: Composite) -> bool:
    """Does the fused kernel compute what the match does? Each composite's result is shaped and
    typed like its first operand (its fake says so), and a fused kernel binds all its operands to
    one element type: a match that promotes (x · int64 cos is float32), or broadcasts past its
    first operand, is another function."""
    if not c.like_first:
        return True
    out, first = _val(root), _val(args[0])
    if out is None or first is None or (out.shape, out.dtype) != (first.shape, first.dtype):
        return False
    return first.dtype in c.dtypes and all(v.dtype == first.dtype for v in map(_val, args) if v is not None)


def _in_place_for(results: tuple, args: tuple, inside: set) -> bool:
    """Can one node at the root's place replace all of them: does nothing outside the match read
    the other results before the root (before the op that would make them)?"""
    if len(results) == 1:
        return True
    before, n = set(), results[0].prev
    while n.op != "root":
        before.add(n)
        n = n.prev
    return all(u in inside or u not in before for r in results[1:] for u in r.users) and \
        all(a in before for a in args if isinstance(a, fx.Node))


def _replace(g: fx.Graph, results: tuple, op, args: tuple, inside: set) -> None:
    """One node of `op` in place of the results' nodes (getitems of it for several) wherever
    something outside the match reads them."""
    root = results[0]
    with g.inserting_before(root):
        node = g.call_function(op, args)
        items = [g.call_function(operator.getitem, (node, i)) for i in range(len(results))] if len(results) > 1 else [node]
    node.meta = dict(root.meta)
    if len(results) > 1:
        node.meta["val"] = tuple(r.meta["val"] for r in results)
    for item, r in zip(items, results):
        if item is not node:
            item.meta = dict(r.meta)
        r.replace_all_uses_with(item, delete_user_cb=lambda u: u not in inside)


def fuse(graph: CapturedGraph, names: Iterable[str]) -> CapturedGraph:
    """A copy of the graph with each match of the named composites' patterns replaced by one node
    (the graph itself when no composite is named); `stats()["fused"]` counts them by name."""
    chosen = [(n, COMPOSITES[n]) for n in sorted(names)]
    if not chosen:
        return graph
    graph = graph.copy()
    g = graph.gm.graph
    fused: Counter = Counter()
    for root in reversed(list(g.nodes)):
        if root.op != "call_function" or not root.users:  # no users: inside a match fused already
            continue
        for name, c in chosen:
            env: dict = {}
            if not _match(c.pattern, root, env):
                continue
            built = c.build(env)
            if built is None:
                continue
            op, args, *more = built
            results = (root, *(more[0] if more else ()))
            inside = _inside(root, {v for v in env.values() if isinstance(v, fx.Node)})
            if not _qualifies(root, args, c) or (c.exclusive and not _self_contained(inside, results)) \
                    or not _in_place_for(results, args, inside):
                continue
            _replace(g, results, op, args, inside)
            fused[name] += 1
            break
    events.STATS.fused.update(fused)
    return dce(graph) if fused else graph

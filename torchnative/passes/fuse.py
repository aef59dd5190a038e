"""Fusion into named composites: a pattern of Core ATen ops that a delegate maps to one fused
kernel (ONNX Runtime's RMSNormalization and RotaryEmbedding; a tanh GELU for a delegate that has
one) becomes one node.

Fusion runs on a delegate's partition just before it is lowered, with the composites that delegate
names (`Delegate.composites`): a partition that eager runs keeps the ops as recorded, so its
results stay eager's bit for bit. Each composite's eager implementation is its pattern, op for op,
so a fused graph run eagerly equals the unfused one exactly (the tests hold the matchers to that).
Scaled-dot-product attention needs no fusion here: the door records it as one node.
"""
from __future__ import annotations

import math
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


def _self_contained(root: fx.Node, leaves: set) -> bool:
    """Is every node of the match below its root (down to its bound inputs) used inside it alone?
    Else fusing would compute that value twice."""
    inside, stack = {root}, list(root.all_input_nodes)
    while stack:
        n = stack.pop()
        if n not in inside and n not in leaves:
            inside.add(n)
            stack.extend(n.all_input_nodes)
    return all(u in inside for n in inside - {root} for u in n.users)


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


rms_norm_op = torch.ops.torchnative.rms_norm.default
quantized_mm_op = torch.ops.torchnative.quantized_mm.default
rope_op = torch.ops.torchnative.rope.default
gelu_tanh_op = torch.ops.torchnative.gelu_tanh.default


@dataclass(frozen=True)
class Composite:
    pattern: tuple
    build: Callable[[dict], tuple | None]  # bound pattern → (op, args), or None when the match does not qualify
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
            leaves = {v for v in env.values() if isinstance(v, fx.Node)}
            if built is None or not _qualifies(root, built[1], c) or (c.exclusive and not _self_contained(root, leaves)):
                continue
            op, args = built
            with g.inserting_before(root):
                node = g.call_function(op, args)
            node.meta = dict(root.meta)
            root.replace_all_uses_with(node)
            fused[name] += 1
            break
    events.STATS.fused.update(fused)
    return dce(graph) if fused else graph

"""The aten op → candle lowering table: one function per op, called with its output's _Out and
candle values in place of fx nodes, and per op a check of what the lowering does not claim; with
the ops compile folds instead and why candle declines some ops by name."""
from __future__ import annotations

import functools
import math
import operator
from typing import Any, Callable, NamedTuple

import torch
import torch.fx as fx

try:
    import candle  # HF candle's Python bindings (candle-nn)
except ImportError:  # available() says so, with the install hint
    candle = None

from torchnative.delegates.hf_candle.transfer import DTYPES, to_candle

aten = torch.ops.aten


LOWER: dict[Any, Callable] = {}
CHECKS: dict[Any, Callable[[fx.Node], str | None]] = {}


def _lower(*ops, check: Callable[[fx.Node], str | None] | None = None):
    def register(fn):
        for op in ops:
            LOWER[op] = fn
            if check is not None:
                CHECKS[op] = check
        return fn
    return register


class _Out(NamedTuple):
    """What a lowering knows of its node's (first) output, read from the meta once, at load:
    FakeTensor attributes cost microseconds a read."""
    shape: tuple[int, ...]
    dtype: str | None  # candle's name for it


def out_of(n: fx.Node) -> _Out:
    v = n.meta["val"]
    v = v[0] if isinstance(v, (tuple, list)) else v
    return _Out(tuple(v.shape), DTYPES.get(v.dtype))


@functools.cache
def _scalar(value: float, dtype: str):
    # an int stays an int: a float would be read as f32 and lose digits past 2**24
    return candle.Tensor(int(value) if dtype == "i64" else float(value)).to_dtype(dtype)


def _as(o: _Out, v):
    """v (a candle tensor or a Python number) as an operand of the output's dtype."""
    if isinstance(v, (bool, int, float)):
        return _scalar(v, o.dtype)
    return v if str(v.dtype).lower() == o.dtype else v.to_dtype(o.dtype)


def _dims(dims, rank: int) -> list[int]:
    dims = range(rank) if dims is None or len(dims) == 0 else dims
    return sorted(d % rank for d in dims) if rank else []


def _float_out(n: fx.Node) -> str | None:
    v = n.meta["val"]
    v = v[0] if isinstance(v, (tuple, list)) else v
    return None if v.dtype == torch.float32 else f"{v.dtype} arithmetic is not claimed (verified on float32 only)"


def _numeric_out(n: fx.Node) -> str | None:
    """float32, or int64 where candle's integer arithmetic matches eager's (wrapping add, sub, mul)."""
    return None if n.meta["val"].dtype == torch.int64 else _float_out(n)


def _no_alpha(n: fx.Node) -> str | None:
    if n.kwargs.get("alpha", 1) != 1:
        return "alpha != 1: eager fuses it into one rounding (fma), candle rounds twice"
    return _numeric_out(n)


@_lower(aten.add.Tensor, aten.add.Scalar, check=_no_alpha)
def _add(o, x, y, alpha=1):
    return _as(o, x) + _as(o, y)


@_lower(aten.sub.Tensor, aten.sub.Scalar, check=_no_alpha)
def _sub(o, x, y, alpha=1):
    return _as(o, x) - _as(o, y)


@_lower(aten.mul.Tensor, aten.mul.Scalar, check=_numeric_out)
def _mul(o, x, y):
    return _as(o, x) * _as(o, y)


@_lower(aten.div.Tensor, aten.div.Scalar, check=_float_out)
def _div(o, x, y):
    return _as(o, x) / _as(o, y)


def _unary(op, fn: Callable) -> None:
    _lower(op, check=_float_out)(lambda o, x: fn(_as(o, x)))


for _op, _fn in {aten.neg.default: lambda x: x * _scalar(-1.0, "f32"), aten.exp.default: lambda x: x.exp(),
                 aten.log.default: lambda x: x.log(), aten.sqrt.default: lambda x: x.sqrt(),
                 aten.rsqrt.default: lambda x: x.sqrt().recip(), aten.reciprocal.default: lambda x: x.recip(),
                 aten.abs.default: lambda x: x.abs(), aten.sin.default: lambda x: x.sin(),
                 aten.cos.default: lambda x: x.cos(),
                 aten.sigmoid.default: lambda x: ((x * _scalar(-1.0, "f32")).exp() + _scalar(1.0, "f32")).recip(),
                 aten.tanh.default: lambda x: candle.functional.tanh(x),
                 aten.relu.default: lambda x: candle.functional.relu(x)}.items():
    _unary(_op, _fn)


def _gelu_check(n: fx.Node) -> str | None:
    if n.kwargs.get("approximate", n.args[1] if len(n.args) > 1 else "none") != "none":
        return "the tanh approximation of gelu has no candle-nn 0.4.2 binding"
    return _float_out(n)


@_lower(aten.gelu.default, check=_gelu_check)
def _gelu(o, x, approximate="none"):
    return candle.functional.gelu(x)  # candle's gelu_erf


def _pow_check(n: fx.Node) -> str | None:
    if isinstance(n.args[1], bool) or not isinstance(n.args[1], (int, float)):
        return "pow with a non-numeric exponent"
    return _float_out(n)


@_lower(aten.pow.Tensor_Scalar, check=_pow_check)
def _pow(o, x, e):
    # eager's special cases (aten/src/ATen/native/cpu/PowKernel.cpp), so the roundings agree
    special = {2: lambda: x * x, 3: lambda: x * x * x, 0.5: lambda: x.sqrt(), -0.5: lambda: x.sqrt().recip(),
               -1: lambda: x.recip(), -2: lambda: (x * x).recip()}
    return special[e]() if e in special else x.powf(float(e))


def _reduce_check(n: fx.Node) -> str | None:
    if n.kwargs.get("dtype") is not None:
        return "reduction with a dtype argument"
    return (_numeric_out if n.target is aten.sum.dim_IntList else _float_out)(n)


def _reduce(fn: Callable) -> Callable:
    """sum/mean/amax over `dims` (keepdim as eager), from candle's one-dim keepdim reductions."""
    def impl(o, x, dims=None, keepdim=False, dtype=None):
        ds = _dims(dims, len(x.shape))
        y = fn(x, ds)
        return y if keepdim else y.reshape(o.shape)
    return impl


def _sum(x, ds):
    return x.sum_keepdim(ds)


def _mean(x, ds):
    return x.sum_keepdim(ds) / _scalar(math.prod(x.shape[d] for d in ds), "f32")


def _amax(x, ds):
    return functools.reduce(lambda y, d: y.max_keepdim(d), ds, x)


_lower(aten.sum.dim_IntList, check=_reduce_check)(_reduce(_sum))
_lower(aten.mean.dim, check=_reduce_check)(_reduce(_mean))
_lower(aten.amax.default, check=_float_out)(_reduce(_amax))
_lower(aten.mean.default, check=_reduce_check)(lambda o, x, dtype=None: _mean(x, _dims(None, len(x.shape))).reshape(()))


def _scalar_input(n: fx.Node) -> str | None:
    return "a 0-d input (candle's dim-wise ops need a dimension)" if n.args[0].meta["val"].dim() == 0 else None


def _softmax_check(n: fx.Node) -> str | None:
    return "half_to_float softmax" if n.args[2] else _scalar_input(n) or _float_out(n)


@_lower(aten._softmax.default, check=_softmax_check)
def _softmax(o, x, dim, half_to_float):
    return candle.functional.softmax(x, dim)


@_lower(aten._log_softmax.default, check=_softmax_check)
def _log_softmax(o, x, dim, half_to_float):
    d = dim % len(x.shape)
    shifted = x - x.max_keepdim(d)
    return shifted - shifted.exp().sum_keepdim(d).log()


@_lower(aten.native_layer_norm.default, check=_float_out)
def _layer_norm(o, x, normalized_shape, weight, bias, eps):
    rank = len(x.shape)
    dims = list(range(rank - len(normalized_shape), rank))
    count = _scalar(math.prod(normalized_shape), "f32")
    mean = x.sum_keepdim(dims) / count
    centered = x - mean
    rstd = ((centered * centered).sum_keepdim(dims) / count + _scalar(eps, "f32")).sqrt().recip()
    y = centered * rstd
    y = y if weight is None else y * weight
    return (y if bias is None else y + bias), mean, rstd


def _only_first_output(n: fx.Node) -> str | None:
    if any(u.args[1] != 0 for u in n.users):
        return "only the first output is computed (indices / saved statistics are not)"
    return None


def _batch_norm_check(n: fx.Node) -> str | None:
    return _only_first_output(n) or _float_out(n.args[0])


@_lower(aten._native_batch_norm_legit_no_training.default, check=_batch_norm_check)
def _batch_norm(o, x, weight, bias, mean, var, momentum, eps):
    per_channel = (-1,) + (1,) * (len(x.shape) - 2)

    def channel(v):
        return v.reshape(per_channel)

    y = (x - channel(mean)) * (channel(var) + _scalar(eps, "f32")).sqrt().recip()
    y = y if weight is None else y * channel(weight)
    return (y if bias is None else y + channel(bias)), None, None


def _max_pool_check(n: fx.Node) -> str | None:
    x, kernel, stride, padding, dilation, ceil = (*n.args, *[(), 0, 1, False][len(n.args) - 2:])
    kernel, stride, padding, dilation = ([v] * 2 if isinstance(v, int) else list(v)
                                         for v in (kernel, stride or kernel, padding, dilation))
    if x.meta["val"].dim() != 4 or len(set(kernel)) != 1 or len(set(stride)) != 1:
        return "candle's max_pool2d takes a 4-D input and square kernel and stride"
    if any(padding) or any(d != 1 for d in dilation) or ceil:
        return "candle's max_pool2d has no padding, dilation or ceil_mode"
    return _only_first_output(n) or _float_out(x)


@_lower(aten.max_pool2d_with_indices.default, check=_max_pool_check)
def _max_pool(o, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    return candle.functional.max_pool2d(x, kernel[0], stride=(stride or kernel)[0]), None


def _matmul_check(n: fx.Node) -> str | None:
    if n.kwargs.get("beta", 1) != 1 or n.kwargs.get("alpha", 1) != 1:
        return "addmm with beta/alpha != 1"
    return _float_out(n)


def _dense(x):
    """x laid out row-major: candle's matmul, gather and index_select refuse most other strides."""
    return x if x.is_contiguous() else x.contiguous()


def _matmul(x, w):
    if isinstance(w, candle.QTensor):  # a quantized weight, stored transposed
        return w.matmul_t(_dense(x))
    return _dense(x).matmul(_dense(w))


_lower(aten.mm.default, aten.bmm.default, check=_matmul_check)(lambda o, x, w: _matmul(x, w))
_lower(aten.addmm.default, check=_matmul_check)(lambda o, bias, x, w, beta=1, alpha=1: _matmul(x, w) + bias)
MAT2 = {aten.mm.default: 1, aten.bmm.default: 1, aten.addmm.default: 2}  # which argument is the weight


def _sdpa_check(n: fx.Node) -> str | None:
    if (n.args[3] if len(n.args) > 3 else n.kwargs.get("dropout_p", 0.0)) != 0:
        return "attention dropout"
    mask = n.kwargs.get("attn_mask")
    if mask is not None and mask.meta["val"].dtype != torch.float32:
        return "boolean attention masks"
    if any(isinstance(t.target, torch._ops.OpOverload) and t.target._schema.name.split("::")[1].startswith(_WRITES)
           for t in n.args[1:3]):
        return ("k/v are a cache that eager writes (index_put): moving the whole cache into candle every call "
                "costs more than the attention")
    return _float_out(n.args[0])


@_lower(aten._scaled_dot_product_flash_attention_for_cpu.default, check=_sdpa_check)
def _sdpa(o, q, k, v, dropout_p=0.0, is_causal=False, *, attn_mask=None, scale=None):
    b, h, length, e = q.shape
    hk, s = k.shape[1], k.shape[2]
    if hk != h:  # grouped-query attention: each k/v head serves h // hk query heads
        k, v = (t.unsqueeze(2).broadcast_as((b, hk, h // hk, s, t.shape[3])).reshape((b, h, s, t.shape[3]))
                for t in (k, v))
    scores = _matmul(q, k.transpose(2, 3)) * _scalar(scale or 1 / math.sqrt(e), "f32")
    if is_causal:
        scores = scores + _causal(length, s)
    if attn_mask is not None:
        scores = scores + attn_mask
    # a query the mask hides from every key (a padded position) attends to nothing, as in eager's
    # kernel: its peak floored to a finite value, its total to the least float, weights 0 not NaN
    # (a row that sees a key has a finite peak and a total of at least 1: both unchanged)
    peak = _at_least(scores.max_keepdim(3), torch.finfo(torch.float32).min)
    weights = (scores - peak).exp()
    total = weights.sum_keepdim(3)
    return _matmul(weights / _at_least(total, torch.finfo(torch.float32).tiny), v), (peak + total.log()).squeeze(3)


def _at_least(x, floor: float):
    """max(x, floor) along a last dim of size 1 (candle-nn's bindings have no maximum)."""
    return candle.cat([x, _scalar(floor, "f32").broadcast_as(x.shape)], 3).max_keepdim(3)


@functools.cache
def _causal(length: int, s: int):
    """0 where query i may see key j (j <= i, top-left aligned like eager), -inf elsewhere."""
    mask = torch.zeros(length, s).masked_fill(torch.ones(length, s, dtype=torch.bool).triu(1), float("-inf"))
    return to_candle([mask])[0]


# shape-only ops: the output shape is known statically, from the node's meta
_lower(aten.view.default, aten.unsqueeze.default, aten.squeeze.dim, aten.squeeze.dims)(
    lambda o, x, *_: x.reshape(o.shape))
_lower(aten.expand.default)(lambda o, x, *_, **__: x.broadcast_as(o.shape))
_lower(aten.alias.default, aten.clone.default)(lambda o, x, **_: x)


@_lower(aten.permute.default)
def _permute(o, x, dims):
    order = list(range(len(x.shape)))
    for i, d in enumerate(d % len(order) for d in dims):  # candle has transpose, not permute
        j = order.index(d)
        if j != i:
            x, order[i], order[j] = x.transpose(i, j), order[j], order[i]
    return x


def _slice_check(n: fx.Node) -> str | None:
    return "slice with a step other than 1" if (n.args[4] if len(n.args) > 4 else 1) != 1 else None


@_lower(aten.slice.Tensor, check=_slice_check)
def _slice(o, x, dim=0, start=None, end=None, step=1):
    d = dim % len(x.shape)
    start, _, _ = slice(start, end).indices(x.shape[d])
    return x.narrow(d, start, o.shape[d])


@_lower(aten.select.int)
def _select(o, x, dim, index):
    d = dim % len(x.shape)
    return x.narrow(d, index % x.shape[d], 1).squeeze(d)


def _cat_check(n: fx.Node) -> str | None:
    if len({t.meta["val"].dtype for t in n.args[0]}) != 1:
        return "cat of mixed dtypes (eager promotes)"
    return None


@_lower(aten.cat.default, check=_cat_check)
def _cat(o, tensors, dim=0):
    return candle.cat(tensors, dim % len(o.shape))


def _cast_check(n: fx.Node) -> str | None:
    if set(n.kwargs) - {"dtype", "layout", "device", "memory_format"} or \
            n.kwargs.get("device") not in (None, torch.device("cpu")):
        return "_to_copy to another device or layout"
    src, dst = n.args[0].meta["val"].dtype, n.meta["val"].dtype
    if src.is_floating_point and dst == torch.int64:
        return f"{src} → {dst}: candle saturates NaN and out-of-range values, eager does not"
    return None


@_lower(aten._to_copy.default, check=_cast_check)
def _to_copy(o, x, **_):
    # candle truncates to u8; eager's bool is "not zero"
    return x != 0 if o.dtype == "u8" and str(x.dtype) != "U8" else x.to_dtype(o.dtype)


def _compare_check(n: fx.Node) -> str | None:
    a, b = n.args
    if isinstance(b, fx.Node) and a.meta["val"].dtype != b.meta["val"].dtype:
        return "comparison of mixed dtypes (eager promotes)"
    if isinstance(b, bool) or a.meta["val"].dtype == torch.bool:
        return "comparison of booleans"
    return None


for _name, _op in {"eq": operator.eq, "ne": operator.ne, "lt": operator.lt, "le": operator.le, "gt": operator.gt,
                   "ge": operator.ge}.items():
    _lower(getattr(aten, _name).Tensor, getattr(aten, _name).Scalar, check=_compare_check)(
        lambda o, x, y, op=_op: op(x, y))
_lower(aten.logical_not.default, check=lambda n: None if n.args[0].meta["val"].dtype == torch.bool
       else "logical_not of a non-boolean tensor")(lambda o, x: x == 0)


@_lower(aten.where.self,
        check=lambda n: None if n.args[0].meta["val"].dtype == torch.bool else "where with a non-boolean condition")
def _where(o, cond, x, y):
    shape = o.shape
    x, y = (_as(o, t).broadcast_as(shape) for t in (x, y))
    return cond.broadcast_as(shape).where_cond(x, y)  # candle wants one shape for all three


def _index_check(n: fx.Node) -> str | None:
    return _scalar_input(n) or (None if n.args[-1].meta["val"].dtype == torch.int64 else "indices that are not int64")


@_lower(aten.embedding.default,
        check=lambda n: None if n.args[1].meta["val"].dtype == torch.int64 else "indices that are not int64")
def _embedding(o, weight, indices, *_):
    return weight.index_select(indices.flatten_all(), 0).reshape(o.shape)


@_lower(aten.index_select.default, check=_index_check)
def _index_select(o, x, dim, index):
    return _dense(x).index_select(index.flatten_all(), dim % len(x.shape))


def _gather_check(n: fx.Node) -> str | None:
    x, dim, index = (a.meta["val"] if isinstance(a, fx.Node) else a for a in n.args[:3])
    same = x.dim() == index.dim() and all(a == b for i, (a, b) in enumerate(zip(x.shape, index.shape))
                                          if i != dim % x.dim())
    if not same:
        return "candle's gather needs the index shaped like the input outside `dim`"
    return _scalar_input(n) or (None if index.dtype == torch.int64 else "indices that are not int64")


@_lower(aten.gather.default, check=_gather_check)
def _gather(o, x, dim, index, sparse_grad=False):
    return _dense(x).gather(_dense(index), dim % len(x.shape))


# Made from arguments alone: compile computes them with torch, once (see fold.py).
CONSTANT = frozenset({aten.full.default, aten.arange.start_step, aten.scalar_tensor.default})

# why candle declines some ops by name
_WRITES = ("index_put", "index_copy", "scatter")
MISSING = {"convolution": "candle-nn 0.4.2's Python bindings have no convolution",
           "index_put": "candle-nn 0.4.2 has no scatter/index_put (in-place updates such as a KV cache's stay "
                        "in eager)",
           "scatter": "candle-nn 0.4.2 has no scatter/index_put",
           "index_copy": "candle-nn 0.4.2 has no scatter/index_put",
           "cumsum": "candle-nn 0.4.2's Python bindings have no cumsum"}

"""Shape inference for recorded ops: meta execution, cached by (op, input metadata, scalars).

Meta kernels cost 100–1300 µs per op in torch 2.13, so the cache matters on the cold path; the
warm path never gets here (the recording trie carries the output metadata of every edge).
"""
from __future__ import annotations

from typing import Any

import torch
from torchnative.lru import Lru
from torchnative.shim.door import LazyTensor, no_dispatch_modes

Meta = tuple  # (shape, stride, storage_offset, dtype)

_META = torch.device("meta")
_cache = Lru(1 << 16, "inferred shapes")


def forget() -> None:
    """Drop every inferred output shape."""
    _cache.clear()


class Unrecordable(Exception):
    """The op cannot be recorded with these arguments; the message says why."""


_offset = torch._C.TensorBase.storage_offset  # a pending tensor's own, not LazyTensor.storage_offset's


def meta_of(t: torch.Tensor) -> Meta:
    return (tuple(t.shape), tuple(t.stride()), _offset(t), t.dtype)


def recorded_meta(t: torch.Tensor) -> Meta:
    """`t`'s metadata as a graph records it: a pending value's own; a real tensor (a graph input)
    at offset 0, where it sits in its storage left out (Recorder.new_input)."""
    if type(t) is LazyTensor:
        if t._slot >= 0:
            return meta_of(t)
        t = t._value
    return (tuple(t.shape), tuple(t.stride()), 0, t.dtype)


def meta_tensor(m: Meta) -> torch.Tensor:
    shape, stride, offset, dtype = m
    if offset == 0:
        return torch.empty_strided(shape, stride, dtype=dtype, device=_META)
    extent = offset + 1 + sum((s - 1) * st for s, st in zip(shape, stride) if s > 0)
    return torch.empty(extent, dtype=dtype, device=_META).as_strided(shape, stride, offset)


def _key(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return ("T",) + recorded_meta(x)
    if type(x) in (list, tuple):
        return tuple(_key(v) for v in x)
    if type(x) is dict:
        return tuple((k, _key(v)) for k, v in x.items())
    if type(x) is float:
        return "\0f" + x.hex()
    if type(x) is bool:
        return "\0T" if x else "\0F"
    return x


def _to_meta(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu":
            raise Unrecordable(f"tensor on {x.device}: capture records CPU tensors only")
        if x.layout != torch.strided:
            raise Unrecordable(f"{x.layout} tensors are not recorded")
        return meta_tensor(recorded_meta(x))
    if type(x) in (list, tuple):
        return type(x)(_to_meta(v) for v in x)
    if isinstance(x, torch.device):
        return _META
    return x


def _out_meta(out: Any) -> tuple:
    if isinstance(out, torch.Tensor):
        return (meta_of(out),)
    if isinstance(out, (list, tuple)) and all(o is None or isinstance(o, torch.Tensor) for o in out):
        return tuple(None if o is None else meta_of(o) for o in out)
    raise Unrecordable(f"returns {type(out).__name__}, not tensors")


def infer(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> tuple[tuple, type | None]:
    """Output metadata of `op` on these arguments, and the sequence type (list/tuple) it
    returns its outputs in, or None for a single tensor."""
    key = (op, _key(args), _key(kwargs))
    hit = _cache.get(key)
    if hit is None:
        hit = _cache[key] = _infer(op, args, kwargs)
    if isinstance(hit, Unrecordable):
        raise hit
    return hit


def _infer(op, args, kwargs):
    try:
        margs = _to_meta(args)
        mkwargs = {k: _to_meta(v) for k, v in kwargs.items()}
        if "device" not in mkwargs and _is_factory(op):
            mkwargs["device"] = _META
        with no_dispatch_modes():
            out = op(*margs, **mkwargs)
        return _as_cpu(op, args, kwargs, _out_meta(out)), (None if isinstance(out, torch.Tensor) else type(out))
    except Unrecordable as e:
        return e
    except Exception as e:  # no meta kernel, data-dependent shape, ...
        return Unrecordable(f"no shape inference for {op}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}")


aten = torch.ops.aten
# batch norm ops -> the position of their `training` flag (None: never training)
_BATCH_NORMS = {aten._native_batch_norm_legit_no_training.default: None, aten.native_batch_norm.default: 5,
                aten._native_batch_norm_legit.default: 5, aten._native_batch_norm_legit_functional.default: 5}


def _as_cpu(op, args: tuple, kwargs: dict, metas: tuple) -> tuple:
    """The outputs as the CPU kernel makes them where its meta kernel differs: an eval-mode batch
    norm's saved mean and invstd are empty on CPU (its backward reads the running statistics),
    one per channel on meta. A graph's metadata is what its delegates' outputs are checked against."""
    at = _BATCH_NORMS.get(op, False)
    if at is False:
        return metas
    if at is not None and (args[at] if len(args) > at else kwargs.get("training")):
        return metas
    empty = lambda m: ((0,), (1,), 0, m[3])  # noqa: E731
    return (metas[0], empty(metas[1]), empty(metas[2]), *metas[3:])


def _is_factory(op) -> bool:
    return any(a.name == "device" for a in op._schema.arguments)

"""The value type of the door: a wrapper tensor that is either pending or materialized.

A *pending* LazyTensor has metadata only and names a value (its slot) of the graph being
recorded. A *materialized* one holds a real tensor in `_value` and behaves like it; a
materialized view holds a real alias of its base, so later in-place updates are shared as in
eager. Everything here is state; the rules that change it live in `torchnative.capture`.
"""
from __future__ import annotations

from typing import Any

import torch

from torchnative.shim import door

_make = torch.Tensor._make_wrapper_subclass


class LazyTensor(torch.Tensor):
    # Fields (set by the recorder, read on every op):
    #   _slot   value index in the pending graph, or -1 once materialized
    #   _value  the real tensor once materialized
    #   _vbase  root base (LazyTensor or real tensor) when this is a view recorded lazily
    #   _vchain view ops from _vbase to this tensor: ((op, args_after_self, kwargs), ...)
    #   _bgen   base generation seen when _slot was computed (a view is stale when it differs)
    #   _epoch  recorder mutation epoch seen last (cheap "nothing changed since" check)
    #   _gen    mutation generation of this tensor when it is a base
    # Defaults live on the class so that creating a pending tensor sets only `_slot`.
    _slot = -1
    _value = None
    _vbase = None
    _gen = 0
    __torch_function__ = torch._C._disabled_torch_function_impl

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return door._aten_dispatch(func, args, kwargs or {})

    # -- sync points that do not pass the dispatcher --------------------------------------------
    def materialize(self, reason: str) -> torch.Tensor:
        """The real tensor behind this one, running the pending graph first if needed."""
        handler = door.current_handler()
        if handler is not None:
            handler.sync(self, reason)
        if self._value is None:
            raise RuntimeError(
                "torchnative: a lazy tensor was used after its capture ended without being "
                "materialized (was it created in another thread's capture?)"
            )
        return self._value

    def tolist(self) -> Any:
        return self.materialize(".tolist()").tolist()

    def numpy(self, *, force: bool = False):
        return self.materialize(".numpy()").numpy(force=force)

    def __array__(self, dtype=None, copy=None):
        arr = self.materialize("__array__").numpy()
        return arr if dtype is None else arr.astype(dtype)

    def data_ptr(self) -> int:
        return self.materialize(".data_ptr()").data_ptr()

    def untyped_storage(self):
        return self.materialize(".untyped_storage()").untyped_storage()

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.materialize("repr/print"))

    def __format__(self, spec: str) -> str:
        return format(self.materialize("format/print"), spec)

    def __reduce_ex__(self, protocol):
        return self.materialize("pickle").__reduce_ex__(protocol)

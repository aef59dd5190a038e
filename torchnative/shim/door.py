"""The door: the one function every aten op of a captured program passes through, and the value
type it returns.

Upstream torch reaches it through `DoorMode` and `LazyTensor.__torch_dispatch__`; a future
candle-backed `torch._C` calls `_aten_dispatch` directly. What happens behind the door is decided
by the handler installed for the current thread: the capture recorder while capturing, plain
eager execution on materialized values otherwise.

A LazyTensor is either pending or materialized. A *pending* one has metadata only and names a
value (its slot) of the graph being recorded. A *materialized* one holds a real tensor in `_value`
and behaves like it; a materialized view holds a real alias of its base, so later in-place updates
are shared as in eager. The LazyTensor is state only; the rules that change it live in
`torchnative.recording`.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import numpy as np
import torch
from torch.utils._python_dispatch import _len_torch_dispatch_stack, _pop_mode, _push_mode

Handler = Callable[[torch._ops.OpOverload, tuple, dict], Any]

_offset = torch._C.TensorBase.storage_offset  # the wrapper's own (LazyTensor.storage_offset says eager's)
_local = threading.local()


def _aten_dispatch(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    handler = getattr(_local, "handler", None)
    if handler is None:
        return run_eagerly(op, args, kwargs)
    return handler(op, args, kwargs)


def current_handler() -> Handler | None:
    return getattr(_local, "handler", None)


def set_handler(handler: Handler | None) -> Handler | None:
    """Install `handler` for this thread; returns the previous one (to restore it later)."""
    previous = getattr(_local, "handler", None)
    _local.handler = handler
    return previous


def _value_of(x: Any) -> Any:
    if type(x) is LazyTensor:
        # a materialized value needs no sync: the op that reads it is the handler's to report
        return x._value if x._slot < 0 and x._value is not None else x.materialize("eager op on a lazy tensor")
    if type(x) in (list, tuple):
        return type(x)(_value_of(v) for v in x)
    return x


@contextmanager
def no_dispatch_modes() -> Iterator[None]:
    """This thread's dispatch modes (the door's) off for the block. torch's
    `_disable_current_modes` also pops the pre-dispatch modes, whose state is one per process:
    while a background compile runs torch.export, it took the export's proxy mode from that
    thread (its export lost it; putting it back failed with "slot already occupied")."""
    modes = [_pop_mode() for _ in range(_len_torch_dispatch_stack())]
    try:
        yield
    finally:
        for mode in reversed(modes):
            _push_mode(mode)


def run_eagerly(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run `op` on the real values behind any lazy arguments.

    An op that returns one of its (lazy) arguments — in-place and out= ops — returns that same
    Python object, so `y = x.add_(1); y is x` holds as in eager.
    """
    values = tuple(_value_of(a) for a in args)
    kvalues = {k: _value_of(v) for k, v in kwargs.items()} if kwargs else {}
    with no_dispatch_modes():
        out = op(*values, **kvalues)
    if isinstance(out, torch.Tensor):
        for a, v in zip(args, values):
            if v is out:
                return a
        for k, v in kvalues.items():
            if v is out:
                return kwargs[k]
    return out


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
        return _aten_dispatch(func, args, kwargs or {})

    def storage_offset(self) -> int:
        """Where eager's tensor would sit in its storage. A graph records an argument as if at
        its storage's start (recording.recorder.Recorder.new_input), so a pending view of one
        carries its offset from the argument's start."""
        if self._slot < 0:
            return _offset(self._value) if self._value is not None else _offset(self)
        base = self._vbase
        if type(base) is LazyTensor:
            base = base._value if base._slot < 0 else None
        return _offset(self) + (_offset(base) if base is not None else 0)

    # -- sync points that do not pass the dispatcher --------------------------------------------
    def materialize(self, reason: str) -> torch.Tensor:
        """The real tensor behind this one, running the pending graph first if needed."""
        handler = current_handler()
        if handler is not None:
            handler.sync(self, reason)
        if self._value is None:
            raise RuntimeError(
                "torchnative: a lazy tensor was used after its capture ended without being "
                "materialized (was it created in another thread's capture?)"
            )
        return self._value

    def _read(self, call: str, read: Callable[[torch.Tensor], Any]) -> Any:
        """`read(value)` on the real tensor behind this one, as eager would run it on this tensor.

        The door stays out of the read: the C++ of `numpy()` and friends dispatches ops of its
        own (`detach`), which the door would record as pending tensors with no memory behind
        them. The value carries no autograd history: a tensor that requires grad is read as a
        leaf that does, so that `numpy()` and DLPack export refuse it as eager does.
        """
        value = self.materialize(call)
        with no_dispatch_modes():
            if self.requires_grad:
                value = value.detach().requires_grad_()
            return read(value)

    def tolist(self) -> Any:
        return self._read(".tolist()", torch.Tensor.tolist)

    def numpy(self, *, force: bool = False):
        return self._read(".numpy()", lambda v: v.numpy(force=force))

    def __array__(self, dtype=None, copy=None):
        # eager's __array__ is `numpy()` and takes no `copy`, so numpy applies `copy` itself;
        # np.array applies it alike (a copy=True array never shares the tensor's memory)
        return np.array(self._read("__array__", torch.Tensor.numpy), dtype=dtype, copy=copy)

    def __dlpack__(self, **kwargs):
        return self._read("__dlpack__", lambda v: v.__dlpack__(**kwargs))

    def data_ptr(self) -> int:
        return self._read(".data_ptr()", torch.Tensor.data_ptr)

    def untyped_storage(self):
        return self._read(".untyped_storage()", torch.Tensor.untyped_storage)

    def __repr__(self, *, tensor_contents=None) -> str:
        return repr(self.materialize("repr/print"))

    def __format__(self, spec: str) -> str:
        return format(self.materialize("format/print"), spec)

    def __reduce_ex__(self, protocol):
        return self.materialize("pickle").__reduce_ex__(protocol)

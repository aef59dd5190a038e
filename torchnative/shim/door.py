"""The door: the one function every aten op of a captured program passes through.

Upstream torch reaches it through `DoorMode` and `LazyTensor.__torch_dispatch__`; a future
candle-backed `torch._C` calls `_aten_dispatch` directly. What happens behind the door is decided
by the handler installed for the current thread: the capture recorder while capturing, plain
eager execution on materialized values otherwise.
"""
from __future__ import annotations

import threading
from typing import Any, Callable

import torch

from torchnative.shim.lazy_tensor import LazyTensor

Handler = Callable[[torch._ops.OpOverload, tuple, dict], Any]

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


def run_eagerly(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """Run `op` on the real values behind any lazy arguments.

    An op that returns one of its (lazy) arguments — in-place and out= ops — returns that same
    Python object, so `y = x.add_(1); y is x` holds as in eager.
    """
    values = tuple(_value_of(a) for a in args)
    kvalues = {k: _value_of(v) for k, v in kwargs.items()} if kwargs else {}
    with torch.utils._python_dispatch._disable_current_modes():
        out = op(*values, **kvalues)
    if isinstance(out, torch.Tensor):
        for a, v in zip(args, values):
            if v is out:
                return a
        for k, v in kvalues.items():
            if v is out:
                return kwargs[k]
    return out

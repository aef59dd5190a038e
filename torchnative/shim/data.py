"""`t.data = v` and a real tensor's `t.numpy()` while a capture records: a tensor write and a read
the door cannot see as such. Python's `.data =` goes to torch's C getset, not to the dispatcher,
so an EMA teacher updated inside a step (`t_p.data = a * t_p.data + (1 - a) * s_p.data`) would
hand a pending lazy value's storage to a real parameter (it crashed), and a parameter with writes
pending in the graph would get them after its new memory (eager's went to the old). While any
capture session is active, `.data` is a property whose setter first makes both real: the pending
graph runs (a sync point), then the assignment is eager's. A real tensor's `numpy()` (and
`np.asarray`, which calls it) is torch's C++, whose inner `detach` passed the door and came back
pending, without memory ("Cannot access data pointer"): it runs with the door off, after the
writes pending to the tensor, and the call does not replay (Python read data)."""
from __future__ import annotations

import threading
from typing import Any

import torch
from torch.utils._python_dispatch import _len_torch_dispatch_stack

from torchnative.shim.door import LazyTensor, current_handler, no_dispatch_modes

_DATA = torch._C.TensorBase.data  # torch's own getset descriptor
_NUMPY = torch._C.TensorBase.numpy
_active = 0
_lock = threading.Lock()


def _before(t: torch.Tensor) -> None:
    handler = current_handler()
    if handler is not None and type(t) is not LazyTensor:
        handler.written(t, "`.data =` into a tensor the pending graph writes")


def _get(self: torch.Tensor) -> torch.Tensor:
    return _DATA.__get__(self, type(self))


def _set(self: torch.Tensor, value: Any) -> None:
    _before(self)
    if type(value) is LazyTensor:
        value = value.materialize("`.data =` a lazy value")
    _DATA.__set__(self, value)


_PROPERTY = property(_get, _set, doc=_DATA.__doc__)


def _numpy(self: torch.Tensor, *, force: bool = False) -> Any:
    handler = current_handler()
    # a lazy tensor's own numpy reads its value; with the door's mode off (a graph running, a
    # delegate's runner feeding its inputs) numpy is torch's alone
    if handler is None or type(self) is LazyTensor or not _len_torch_dispatch_stack():
        return _NUMPY(self, force=force)
    handler.read_real(self, "`.numpy()` of a tensor the pending graph writes")
    with no_dispatch_modes():
        return _NUMPY(self, force=force)


_numpy.__doc__ = _NUMPY.__doc__


class recorded_data:
    """`with recorded_data():` — `.data =` and `.numpy()` as above for the block (nested and threaded
    blocks count)."""

    def __enter__(self) -> None:
        global _active
        with _lock:
            _active += 1
            if _active == 1:
                torch.Tensor.data, torch.Tensor.numpy = _PROPERTY, _numpy

    def __exit__(self, *_: Any) -> None:
        global _active
        with _lock:
            _active -= 1
            if _active == 0:
                del torch.Tensor.data, torch.Tensor.numpy

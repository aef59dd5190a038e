"""`t.data = v` while a capture records: the one tensor write the door cannot see. Python's
`.data =` goes to torch's C getset, not to the dispatcher, so an EMA teacher updated inside a step
(`t_p.data = a * t_p.data + (1 - a) * s_p.data`) would hand a pending lazy value's storage to a
real parameter (it crashed), and a parameter with writes pending in the graph would get them
after its new memory (eager's went to the old). While any capture session is active, `.data` is
a property whose setter first makes both real: the pending graph runs (a sync point), then the
assignment is eager's."""
from __future__ import annotations

import threading
from typing import Any

import torch

from torchnative.shim.door import LazyTensor, current_handler

_DATA = torch._C.TensorBase.data  # torch's own getset descriptor
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


class recorded_data:
    """`with recorded_data():` — `.data =` as above for the block (nested and threaded blocks count)."""

    def __enter__(self) -> None:
        global _active
        with _lock:
            _active += 1
            if _active == 1:
                torch.Tensor.data = _PROPERTY

    def __exit__(self, *_: Any) -> None:
        global _active
        with _lock:
            _active -= 1
            if _active == 0:
                del torch.Tensor.data

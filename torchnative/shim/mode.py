"""Binding of the door to upstream torch.

A TorchDispatchMode sees what a tensor subclass alone never sees: factory ops (`arange`,
`full`, `lift_fresh`), ops on real parameters alone (`W.t()` inside linear) and writes of a lazy
value into a real buffer (a KV cache `index_copy_`).
"""
from __future__ import annotations

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchnative.shim import door


class DoorMode(TorchDispatchMode):
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        # torch wraps a mode's __torch_dispatch__ in a dynamo-disable shim otherwise: several µs
        # per op on the door's hot path, for a guarantee we do not need (nothing compiles there).
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return door._aten_dispatch(func, args, kwargs or {})

    def push(self) -> None:
        """Re-enter the mode from inside the door (inside `__torch_dispatch__` it is popped),
        so ops that a decomposition runs on real tensors still reach the door."""
        torch._C._push_on_torch_dispatch_stack(self)

    @staticmethod
    def pop() -> None:
        torch._C._pop_torch_dispatch_stack(None)

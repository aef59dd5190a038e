"""The door (`_aten_dispatch`) and its binding to upstream torch."""
from torchnative.shim.door import LazyTensor, _aten_dispatch, current_handler, run_eagerly, set_handler
from torchnative.shim.mode import DoorMode

__all__ = ["_aten_dispatch", "current_handler", "run_eagerly", "set_handler", "LazyTensor", "DoorMode"]

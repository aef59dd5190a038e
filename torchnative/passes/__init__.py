"""CapturedGraph → CapturedGraph passes (DESIGN.md §4), run once when a program is built.

Functionalization is not one of them: the recorder functionalizes at the door (recording/views.py,
Recorder.inplace/assign), because Python reads a tensor written in place, or a view of it, right
after the write, and the lazy value it reads must already be the functional result. Every graph
the passes see is functional, with the real tensors it writes as `state` inputs and outputs; the
only in-place nodes are the state updates passes.state makes."""
from __future__ import annotations

import torch

from torchnative.ir import CapturedGraph
from torchnative.passes.cleanup import cse, hoist_placeholders, undetach
from torchnative.passes.derived import Derived
from torchnative.passes.fold import drop_zero_biases, fold_constants
from torchnative.passes.fuse import mark_halves
from torchnative.passes.pin import apply_pins
from torchnative.passes.quantize import quantize_weights
from torchnative.passes.state import slice_updates


def prepare(graph: CapturedGraph, inputs: list[torch.Tensor], quantize: str | None = None,
            eager_only: bool = False) -> tuple[CapturedGraph, Derived]:
    """Pinned roles, CSE/DCE, constant folding (zero biases dropped), weight quantization, a
    state's slice writes in place (passes.state); values marked for fusion (which runs per
    partition, before a delegate compiles it). The Derived tensors are appended to the
    program's inputs on every call."""
    derived = Derived()
    graph = mark_halves(cse(hoist_placeholders(apply_pins(undetach(graph.copy()), inputs))))
    graph = drop_zero_biases(fold_constants(graph, inputs, derived), inputs, derived)
    if quantize is not None:
        graph = quantize_weights(graph, inputs, quantize, derived, once=eager_only)
    return slice_updates(graph), derived

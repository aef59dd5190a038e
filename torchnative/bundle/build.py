"""One call of a model, captured and compiled for a bundle: the call is recorded on eager (fast,
no compile), described as a replay trace (runtime/trace.py: programs in order, where each input
comes from, the scalars Python read), then each program is built again for the target delegates
with its artifacts kept."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Sequence

import torch
from torch.utils import _pytree as pytree

from torchnative.bundle.format import BundleError
from torchnative.delegates import resolve
from torchnative.passes.pin import name_tensors
from torchnative.runtime.pipeline import build_program
from torchnative.runtime.trace import Ineligible, Trace
from torchnative.runtime.tracer import Tracer
from torchnative.runtime.session import real_outputs, session


@dataclass
class Compiled:
    trace: Trace                       # its programs built for the targets, artifacts kept
    inputs: dict[str, torch.Tensor]    # the example inputs, by argument name
    output_names: list[str]            # one per flattened output leaf
    weight_names: dict[int, str]       # id(parameter or buffer) -> its name in the model
    reference: list                    # eager's flattened outputs on the example inputs


def leaf_name(path: tuple) -> str:
    """`(MappingKey('logits'),)` -> "logits"; a tuple position -> "output_0"."""
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(key) if not isinstance(key, int) else f"output_{key}" if not parts else str(key))
    return ".".join(parts) or "output"


def capture_call(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> tuple[Trace, list, list]:
    """The trace of `model(**inputs)` recorded on eager, the programs' run inputs, and the output."""
    buffers = frozenset(id(b) for b in model.buffers())
    leaves = list(inputs.values())
    tracer = Tracer()
    with torch.no_grad(), session(["eager"], buffers, tracer, compile_after=1):
        out = model(**inputs)
    out = real_outputs(out)
    is_weight = lambda x: isinstance(x, torch.nn.Parameter) or id(x) in buffers  # noqa: E731
    try:
        with torch.no_grad():
            trace = tracer.trace(leaves, is_weight, out)
    except Ineligible as e:
        raise BundleError(f"this call of {type(model).__name__} cannot be saved as a bundle: {e}. A bundle "
                          f"runs without the model's Python, so everything the call computes must pass "
                          f"through captured graphs") from e
    if any(step.writes for step in trace.steps):
        raise BundleError(f"{type(model).__name__} writes into tensors during the call (state such as a KV "
                          f"cache or BatchNorm statistics in train mode); bundles do not carry state yet")
    return trace, [run[1] for run in tracer.runs], out


def compile_trace(trace: Trace, run_inputs: list, targets: Sequence[str] | None, quantize: str | None = None) -> Trace:
    """Each program of `trace` built again for `targets` (preference order), artifacts kept."""
    delegates = resolve(targets)
    steps = tuple(dataclasses.replace(step, program=build_program(step.program.captured, delegates, args, quantize, keep_artifacts=True))
                  for step, args in zip(trace.steps, run_inputs))
    return dataclasses.replace(trace, steps=steps)


def prepare_model(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list:
    """Eval mode, tensors named for pinning; eager's flattened outputs on `inputs`."""
    model.eval()
    name_tensors(model)
    with torch.no_grad():
        return pytree.tree_leaves(model(**inputs))


def compiled(model: torch.nn.Module, inputs: dict[str, torch.Tensor], trace: Trace, out: Any, reference: list) -> Compiled:
    names: dict[int, str] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), n)  # a tied weight is saved once, under its first name
    paths, _ = pytree.tree_flatten_with_path(out)
    return Compiled(trace, dict(inputs), [leaf_name(p) for p, _ in paths], names, reference)


def compile_call(model: torch.nn.Module, inputs: dict[str, torch.Tensor], targets: Sequence[str] | None,
                 quantize: str | None = None) -> Compiled:
    """Capture `model(**inputs)` and compile each of its graphs for `targets` (preference order)."""
    reference = prepare_model(model, inputs)
    trace, run_inputs, out = capture_call(model, inputs)
    return compiled(model, inputs, compile_trace(trace, run_inputs, targets, quantize), out, reference)

"""Pinned tensors: updated at test time (adapted parameters, fast weights), so never folded or
quantized, and passed to delegates as inputs on every call instead of being baked in.

A tensor is pinned by `torchnative.pin`, or automatically when a parameter a compiled program
baked in changed between two runs of the same graph (an optimizer step): its program is rebuilt
once, with the tensor as an input."""
from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch

from torchnative import events
from torchnative.ir import CapturedGraph


@dataclass(frozen=True)
class Pin:
    ref: weakref.ref
    label: str
    reason: str


_pins: dict[int, Pin] = {}
_names: dict[int, tuple[weakref.ref, str]] = {}  # id -> (tensor, "module.param") for labels


def name_tensors(module: torch.nn.Module) -> None:
    """Remember parameter and buffer names of `module`, so reports name what they pin. The most
    qualified name wins: naming a submodule after its model keeps the model's names."""
    for name, t in [*module.named_parameters(), *module.named_buffers()]:
        known = _names.get(id(t))
        if known is None or known[0]() is not t or len(name) > len(known[1]):
            _names[id(t)] = (weakref.ref(t), name)


def label(t: torch.Tensor) -> str:
    known = _names.get(id(t))
    if known is not None and known[0]() is t:
        return known[1]
    return f"tensor {str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def pin(t: torch.Tensor, reason: str) -> bool:
    """Pin `t`; False when it already was."""
    if is_pinned(t):
        return False
    _pins[id(t)] = Pin(weakref.ref(t), label(t), reason)
    events.STATS.pinned[label(t)] = reason
    events.emit(events.Pinned(label(t), reason))
    return True


def is_pinned(t: torch.Tensor) -> bool:
    p = _pins.get(id(t))
    return p is not None and p.ref() is t


def pinned() -> list[torch.Tensor]:
    """Every live pinned tensor."""
    return [t for p in list(_pins.values()) if (t := p.ref()) is not None]


def reason(t: torch.Tensor) -> str:
    return _pins[id(t)].reason if is_pinned(t) else ""


INFERENCE_REASON = ("an inference tensor (made under torch.inference_mode): torch keeps no version of its "
                    "writes, so a program could not tell it changed; never baked")
STATE_REASON = "written in place inside the graph: an input of every run, its new value written back after it"


def apply_pins(graph: CapturedGraph, inputs: list[torch.Tensor]) -> CapturedGraph:
    """`param` inputs that are pinned take the role `pinned`; pinned and state placeholders are
    labelled (meta "updatable": (label, why)) for reports."""
    roles = ["pinned" if r == "param" and (is_pinned(x) or x.is_inference()) else r
             for r, x in zip(graph.input_roles, inputs)]
    placeholders = graph.placeholders()
    for p, r, x in zip(placeholders, roles, inputs):
        if r == "pinned":
            p.meta["updatable"] = (label(x), reason(x) or INFERENCE_REASON)
        elif r == "state":
            p.meta["updatable"] = (label(x), STATE_REASON)
    if roles == graph.input_roles:
        return graph
    return CapturedGraph(graph.gm, roles, graph.output_roles, graph.constants, writes=graph.writes)


def updatable(graph: CapturedGraph) -> list[dict]:
    """The graph's pinned and state inputs: name, role, shape, dtype and why (for reports)."""
    placeholders = graph.placeholders()
    rows = []
    for p, role in zip(placeholders, graph.input_roles):
        if role in ("state", "pinned"):
            name, why = p.meta.get("updatable") or (p.name, STATE_REASON)
            rows.append({"graph": graph.key[:12], "name": name, "role": role, "shape": list(p.meta["val"].shape),
                         "dtype": str(p.meta["val"].dtype).removeprefix("torch."), "reason": why})
    return rows

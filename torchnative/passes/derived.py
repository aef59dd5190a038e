"""Tensors a pass computes from weights when a program is built (quantized weights), added to the
graph as `constant` inputs."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph


@dataclass
class Derived:
    """Tensors a pass computed from weights, appended to the program's inputs on every call, and
    the indices of the inputs they were computed from (a change to those makes them stale)."""
    tensors: list[torch.Tensor] = field(default_factory=list)
    sources: set[int] = field(default_factory=set)


def add_constant(graph: CapturedGraph, like: fx.Node, name: str) -> fx.Node:
    """A new placeholder after the last one (so inputs keep their positions), role `constant`."""
    existing = graph.placeholders()
    g = graph.gm.graph
    with g.inserting_after(existing[-1]) if existing else g.inserting_before(next(iter(g.nodes))):
        p = g.placeholder(name)
    p.meta = dict(like.meta)  # what is known of the value (its shape, that it repeats its halves) holds for the input
    p.meta["role"] = "constant"
    graph.input_roles.append("constant")
    return p

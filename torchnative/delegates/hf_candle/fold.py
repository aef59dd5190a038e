"""The constant folder: the nodes that params alone determine, computed by eager once, at compile."""
from __future__ import annotations

from typing import Any

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph


def fold(graph: CapturedGraph) -> tuple[dict[fx.Node, Any], dict[fx.Node, str]]:
    """Values of the nodes that params alone determine (eager computes them, once), and for those
    that derive from a param, its name."""
    values: dict[fx.Node, Any] = {}
    origin: dict[fx.Node, str] = {}
    for n in graph.gm.graph.nodes:
        if n.op == "placeholder" and n.name in graph.constants:
            values[n], origin[n] = graph.constants[n.name].detach(), n.name
        elif n.op == "call_function" and all(u in values for u in n.all_input_nodes):
            args, kwargs = fx.map_arg((n.args, n.kwargs), values.__getitem__)
            with torch.no_grad():  # compile runs on its own thread, where grad mode is on
                values[n] = n.target(*args, **kwargs)
            sources = [origin[u] for u in n.all_input_nodes if u in origin]
            if sources:
                origin[n] = sources[0]
    return values, origin

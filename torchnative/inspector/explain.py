"""`explain`: what a function captured, where its graph broke and why."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from torchnative import events
from torchnative.ir import CapturedGraph
from torchnative.passes.pin import name_tensors, updatable


@dataclass
class Explanation:
    graphs: list[CapturedGraph] = field(default_factory=list)
    partitions: list[tuple] = field(default_factory=list)  # per graph: ((delegate, n_ops), ...)
    programs: list = field(default_factory=list)           # per graph: its runtime.program.Program
    breaks: list[events.GraphBreak] = field(default_factory=list)
    fallbacks: list[events.Fallback] = field(default_factory=list)
    output: Any = None

    @property
    def updatable(self) -> dict[str, tuple[str, str]]:
        """Pinned and state tensors of the graphs: name -> (role, why)."""
        return {t["name"]: (t["role"], t["reason"]) for g in self.programs for t in updatable(g.graph)}

    @property
    def op_counts(self) -> Counter:
        total: Counter = Counter()
        for g in self.graphs:
            total.update(g.op_counts())
        return total

    @property
    def ops_recorded(self) -> int:
        return sum(self.op_counts.values())

    def __str__(self) -> str:
        lines = [f"{len(self.graphs)} graph(s), {self.ops_recorded} op(s), {len(self.breaks)} graph break(s)"]
        for i, (g, parts) in enumerate(zip(self.graphs, self.partitions)):
            where = " → ".join(f"{d} {n}" for d, n in parts)
            lines.append(f"  graph {i}: {len(g.op_nodes())} ops [{where}], inputs {_roles(g.input_roles)}, "
                         f"outputs {_roles(g.output_roles)}")
        for name, (role, why) in self.updatable.items():
            lines.append(f"  {role} {name}: {why}")
        for b in self.breaks:
            lines.append(f"  break at {b.filename}:{b.line}: {b.reason}")
        for f in self.fallbacks:
            lines.append(f"  fallback from {f.delegate} to eager: {f.reason}")
        top = ", ".join(f"{op.split('.')[1]}×{n}" for op, n in self.op_counts.most_common(8))
        lines.append(f"  top ops: {top}")
        return "\n".join(lines)


def _roles(roles: list[str]) -> str:
    return ", ".join(f"{n} {r}" for r, n in Counter(roles).items()) or "none"


def explain(fn: Callable, *args, **kwargs) -> Explanation:
    """Run fn under capture (inside an enclosing `capture(delegates=...)`, with its delegates)."""
    from torchnative.runtime.session import session  # the inspector only listens; this runs fn

    result = Explanation()
    if isinstance(fn, torch.nn.Module):
        name_tensors(fn)  # reports name its parameters and buffers

    def on_event(e: Any) -> None:
        if isinstance(e, events.GraphRun):
            result.graphs.append(e.graph)
            result.partitions.append(e.partitions)
            result.programs.append(e.program)
        elif isinstance(e, events.GraphBreak):
            result.breaks.append(e)
        elif isinstance(e, events.Fallback):
            result.fallbacks.append(e)

    stop = events.listen(on_event)
    try:
        with session(compile_after=1):  # what it explains is the compiled program, from the first call
            result.output = fn(*args, **kwargs)
    finally:
        stop()
    return result

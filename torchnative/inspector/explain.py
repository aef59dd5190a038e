"""`explain`: what a function captured, where its graph broke and why."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from torchnative import events
from torchnative.inspector.numeric_gap import Checker, PartitionGap
from torchnative.inspector.report import short_path
from torchnative.ir import CapturedGraph
from torchnative.passes.pin import name_tensors, updatable


@dataclass
class Explanation:
    graphs: list[CapturedGraph] = field(default_factory=list)
    partitions: list[tuple] = field(default_factory=list)  # per graph: ((delegate, n_ops), ...)
    programs: list = field(default_factory=list)           # per graph: its build.program.Program
    not_compiled: list[str] = field(default_factory=list)  # per graph: why it ran on eager, or ""
    breaks: list[events.GraphBreak] = field(default_factory=list)
    fallbacks: list[events.Fallback] = field(default_factory=list)
    # with check=True: each delegate partition that ran, against eager on the same inputs
    gaps: list[PartitionGap] = field(default_factory=list)
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
            if self.not_compiled[i]:
                lines.append(f"    not compiled, {self.not_compiled[i]}")
            lines += [f"    {d} declined {k} op(s): {why}" for (d, why), k in _declined(self.programs[i]).most_common(3)]
        for name, (role, why) in self.updatable.items():
            lines.append(f"  {role} {name}: {why}")
        for b in self.breaks:
            lines.append(f"  break at {b.filename}:{b.line}: {b.reason}")
        for f in self.fallbacks:
            lines.append(f"  fallback from {f.delegate} to eager: {f.reason}")
        top = ", ".join(f"{op.split('.')[1]}×{n}" for op, n in self.op_counts.most_common(8))
        lines.append(f"  top ops: {top}")
        if self.gaps:
            diverged = sum(g.diverges for g in self.gaps)
            lines.append(f"  numeric gap vs eager of {len(self.gaps)} delegate partition(s) on the inputs each was given, "
                         f"{diverged} diverging:")
            lines += [_gap_line(g) for g in self.gaps]
        return "\n".join(lines)


def _gap_line(g: PartitionGap) -> str:
    worst = g.worst
    line = (f"    {'DIVERGES ' if g.diverges else ''}{g.id} ({g.n_ops} ops, {g.runs} run(s)): "
            f"max abs {g.max_abs:.3g}, max rel {g.max_rel:.3g}")
    if worst is not None and worst.max_abs > 0:
        where = f" at {short_path(*worst.stack)}" if worst.stack[1] else ""
        line += f", worst output {worst.name} ({worst.op}{where})"
    return line + "; ops from " + ", ".join(f"{short_path(f, n)} ({k})" for f, n, k in g.sources[:3])


def _declined(program) -> Counter:
    """(delegate, reason) -> how many of the program's nodes it declined for that reason."""
    return Counter((d, why) for _, d, why in getattr(program, "declined", ()))


def _roles(roles: list[str]) -> str:
    return ", ".join(f"{n} {r}" for r, n in Counter(roles).items()) or "none"


def explain(fn: Callable, *args, check: bool = False, **kwargs) -> Explanation:
    """Run fn under capture (inside an enclosing `capture(delegates=...)`, with its delegates).
    `check`: each delegate partition's outputs are compared with its graph run on eager on the
    same inputs, on every run (`Explanation.gaps`)."""
    from torchnative.replay.session import session  # the inspector only listens; this runs fn

    result = Explanation()
    if isinstance(fn, torch.nn.Module):
        name_tensors(fn)  # reports name its parameters and buffers

    checker = Checker() if check else None

    def on_event(e: Any) -> None:
        if isinstance(e, events.GraphRun):
            result.graphs.append(e.graph)
            result.partitions.append(e.partitions)
            result.programs.append(e.program)
            result.not_compiled.append(e.not_compiled)
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
        if checker is not None:
            result.gaps = checker.close()
    return result

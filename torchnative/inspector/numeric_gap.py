"""`explain(..., check=True)`: each delegate partition's outputs against its own graph run on eager,
on the inputs the delegate was given (as ExecuTorch's Inspector's `calculate_numeric_gap`). A gap
at the model's outputs says only that something diverged; here each partition is compared on its
own inputs, so an error upstream does not show again downstream and the partition with a gap is
the one that diverges. `fn` does not run again: while explaining, each delegate step's runner
is wrapped, and each of its runs is checked when it happens."""
from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import torch

from torchnative.inspector.profile import source_lines
from torchnative.ir import CapturedGraph, is_weight
from torchnative.partitioner import EAGER
from torchnative.passes.state import SLICE_UPDATE
from torchnative.build.program import AROUND

if TYPE_CHECKING:
    from torchnative.build.program import Program, Step

# a partition diverges when an output's max abs error exceeds this share of the output's largest
# eager magnitude: float32 rounding over a partition's chains of ops stays well below it
DIVERGES = 1e-4


@dataclass
class OutputGap:
    """One output of a partition (or a state it writes in place), the worst over its runs."""
    name: str          # the node's name in the partition's graph
    op: str            # the op that computes it, or "written in place" for a state
    stack: tuple       # (filename, line) of the user code that issued the op
    max_abs: float     # max |delegate - eager|
    max_rel: float     # max_abs / max |eager| (a shape, dtype or NaN mismatch is inf)


@dataclass
class PartitionGap:
    """A delegate partition checked against eager on every run `explain` saw."""
    graph_key: str
    index: int              # its position in its program's steps
    delegate: str
    graph: CapturedGraph    # the partition's own graph: what to bisect
    outputs: list[OutputGap] = field(default_factory=list)
    runs: int = 0

    @property
    def id(self) -> str:
        return f"{self.graph_key[:12]}#{self.index}/{self.delegate}"  # as a profile names partitions

    @property
    def n_ops(self) -> int:
        return len(self.graph.op_nodes())

    @property
    def ops(self) -> Counter:
        return self.graph.op_counts()

    @property
    def sources(self) -> list[list]:
        """User source lines of its ops, most ops first: [file, line, ops]."""
        return source_lines(self.graph)

    @property
    def worst(self) -> OutputGap | None:
        return max(self.outputs, key=lambda o: (o.max_rel, o.max_abs), default=None)

    @property
    def max_abs(self) -> float:
        return max((o.max_abs for o in self.outputs), default=0.0)

    @property
    def max_rel(self) -> float:
        return max((o.max_rel for o in self.outputs), default=0.0)

    @property
    def diverges(self) -> bool:
        return self.max_rel > DIVERGES


def gap(got: Any, want: Any) -> tuple[float, float]:
    """(max abs, max rel) error of a delegate's value against eager's; a value of another shape
    or dtype, or NaN or ±inf where eager has none, is infinitely far."""
    if not isinstance(want, torch.Tensor):
        return (0.0, 0.0) if got == want else (math.inf, math.inf)
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return math.inf, math.inf
    if want.numel() == 0:
        return 0.0, 0.0
    g, w = (torch.view_as_real(t) if t.is_complex() else t for t in (got.detach(), want.detach()))
    g, w = g.double(), w.double()
    same = (g == w) | (g.isnan() & w.isnan())  # inf - inf is nan: equal infinities are found here
    diff = (g - w).abs()
    diff = torch.where(same, 0.0, torch.where(diff.isnan(), math.inf, diff))
    max_abs = diff.max().item()
    finite = w[w.isfinite()]
    scale = finite.abs().max().item() if finite.numel() else 0.0
    if max_abs == 0.0:
        return 0.0, 0.0
    return max_abs, max_abs / scale if scale > 0 else math.inf


class Checker:
    """While open, every delegate partition a program runs (build.program.AROUND) is checked: its
    inputs are copied (a delegate may write a state input in place), the partition's graph runs on
    eager on the copies after the delegate, and the gap of each output is kept, the worst over the
    runs. The programs' runners are never touched. `close()` stops listening."""

    def __init__(self) -> None:
        self.rows: dict[int, tuple[PartitionGap, Callable]] = {}  # by id(step): its row and its check
        AROUND.append(self._around)

    def close(self) -> list[PartitionGap]:
        """The partitions that ran, in the order they first ran."""
        if self._around in AROUND:
            AROUND.remove(self._around)
        return [row for row, _ in self.rows.values() if row.runs]

    def _around(self, program: Program, index: int, step: Step, inputs: list, run: Callable) -> list:
        if step.delegate == EAGER:
            return run(inputs)
        found = self.rows.get(id(step))
        if found is None:
            row = PartitionGap(program.graph.key, index, step.delegate, step.graph)
            found = self.rows[id(step)] = (row, _check(step, row))
        return found[1](inputs, run)


def _check(step: Step, row: PartitionGap) -> Callable:
    graph = step.graph
    placeholders = graph.placeholders()
    runtime = [k for k, role in enumerate(graph.input_roles) if not is_weight(role)]  # the runner's inputs
    written = [k for k, p in enumerate(placeholders)
               if any(u.target is SLICE_UPDATE and u.args[0] is p for u in p.users)]
    outputs = graph.outputs()
    row.outputs = [OutputGap(n.name, str(n.target), tuple(n.meta.get("stack") or ("<unknown>", 0)), 0.0, 0.0)
                   for n in outputs]
    row.outputs += [OutputGap(placeholders[k].name, "written in place", ("<unknown>", 0), 0.0, 0.0) for k in written]

    def checked(inputs: list, run: Callable) -> list:
        args = [graph.constants.get(p.name) for p in placeholders]
        for k, t in zip(runtime, inputs):
            args[k] = t.detach().clone() if isinstance(t, torch.Tensor) else t
        outs = run(inputs)
        want = graph.gm(*args)
        given = dict(zip(runtime, inputs))
        pairs = [*zip(outs, want), *((given[k], args[k]) for k in written)]
        for o, (got, expected) in zip(row.outputs, pairs):
            max_abs, max_rel = gap(got, expected)
            o.max_abs, o.max_rel = max(o.max_abs, max_abs), max(o.max_rel, max_rel)
        row.runs += 1
        return outs

    return checked

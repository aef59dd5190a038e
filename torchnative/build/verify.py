"""Every compiled partition is checked before it is trusted (DESIGN.md §5): when a program is
built, each delegate partition runs once on the values the graph has on its build inputs, beside
the same partition on eager (the whole prepared graph run once on eager), and a partition whose
outputs are further from eager's than its delegate's stated tolerance runs on eager instead —
declined with the numbers (a counted fallback, a warning once per delegate), never silent. A
delegate's bug costs speed, not correctness.

Only what the graph defines is compared: a buffer made with `torch.empty` and partly written
holds whatever memory held, so the graph runs on eager twice, that memory filled with 0 and with
NaN, and the elements that differ are left out."""
from __future__ import annotations

import math
import os
import warnings
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx

from torchnative import events
from torchnative.interface import FLOAT32, FLOAT64, HALF, Tolerance
from torchnative.ir import CapturedGraph

aten = torch.ops.aten
_EMPTY = {aten.empty.memory_format, aten.empty_strided.default, aten.empty_like.default, aten.new_empty.default,
          aten.new_empty_strided.default}
# TORCHNATIVE_VERIFY=0 turns the check off (build_program's `verify`), for a user who knows
ENABLED = os.environ.get("TORCHNATIVE_VERIFY", "1") != "0"


def tolerance_of(delegate: Any, graph: CapturedGraph) -> Tolerance:
    """The delegate's stated tolerance for this partition (FLOAT32 unless it states another),
    HALF's where it is tighter and the partition computes in float16 or bfloat16, FLOAT64's in place
    of FLOAT32's where every float value of the partition is float64."""
    stated = getattr(delegate, "tolerance", None)
    tolerance = stated(graph) if stated is not None else FLOAT32
    floats = {v.dtype for n in graph.gm.graph.nodes for v in _values(n.meta.get("val"))
              if isinstance(v, torch.Tensor) and v.dtype.is_floating_point}
    if floats & {torch.float16, torch.bfloat16}:
        return HALF if tolerance.bound < HALF.bound else tolerance
    return FLOAT64 if floats == {torch.float64} and tolerance == FLOAT32 else tolerance


def _values(val: Any) -> tuple:
    return tuple(val) if isinstance(val, (list, tuple)) else (val,)


# the least scale a float value is measured against: a value that cancels to ~0 (a gradient at the
# first step of a mean teacher, 1e-8) is rounding noise of the O(1) terms it came from, not a gap
_FLOOR = 1e-3


def gap(got: Any, want: Any, kind: str = "scale", defined: torch.Tensor | None = None) -> float:
    """How far a delegate's value is from eager's, in `kind`'s measure, over the `defined`
    elements; a value of another shape or dtype, or NaN or ±inf where eager has none, is inf."""
    if not isinstance(want, torch.Tensor):
        return 0.0 if got == want else math.inf
    if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
        return math.inf
    g, w = (torch.view_as_real(t) if t.is_complex() else t for t in (got.detach(), want.detach()))
    floor = _FLOOR if want.is_floating_point() or want.is_complex() else 0.0
    g, w = g.double(), w.double()
    if defined is not None:
        g, w = g[defined], w[defined]
    if w.numel() == 0:
        return 0.0
    same = (g == w) | (g.isnan() & w.isnan())  # inf - inf is nan: equal infinities are found here
    diff = torch.where(same, 0.0, (g - w).abs().nan_to_num(nan=math.inf))
    finite = w.isfinite()
    if kind == "l2":
        if torch.isinf(diff).any():
            return math.inf
        norm = max(w[finite].norm().item(), floor * math.sqrt(w.numel()))
        error = diff.norm().item()
        return 0.0 if error == 0.0 else error / norm if norm > 0 else math.inf
    worst = diff.max().item()
    scale = max(w[finite].abs().max().item() if finite.any() else 0.0, floor)
    return 0.0 if worst == 0.0 else worst / scale if scale > 0 else math.inf


class _Eager(fx.Interpreter):
    """The graph on eager, the values of the nodes in `keep` kept (the others freed as the graph
    runs: every activation of a ResNet-50 kept cost more than its run); memory `torch.empty` made
    is filled first."""

    def __init__(self, gm: fx.GraphModule, fill: float, keep: set):
        super().__init__(gm)
        self.fill, self.keep, self.values = fill, keep, {}

    def run_node(self, n: fx.Node) -> Any:
        value = super().run_node(n)
        if n.op == "call_function" and n.target in _EMPTY:
            value.fill_(self.fill if value.is_floating_point() else int(self.fill == 0) - 1)
        if n in self.keep:
            self.values[n] = value
        return value


class EagerFails(Exception):
    """The graph fails on eager on the build's inputs (a token id past the vocabulary): the inputs
    are at fault, not a delegate, and no program can be checked on them."""


@dataclass
class Reference:
    """Eager's value of every node of a prepared graph on its build inputs, and, per value that
    memory `torch.empty` made can reach, which of its elements the graph defines."""
    values: dict
    defined: dict


def reference(graph: CapturedGraph, inputs: list, keep: set) -> Reference:
    """The prepared graph on eager, on copies of the states it writes in place (a KV cache); the
    values of the nodes in `keep` (the delegate partitions' inputs and outputs)."""
    args = [t.clone() if role == "state" and isinstance(t, torch.Tensor) else t
            for t, role in zip(inputs, graph.input_roles)]
    fills = (0.0, math.nan) if any(n.target in _EMPTY for n in graph.gm.graph.nodes) else (0.0,)
    runs = []
    with torch.no_grad():
        for fill in fills:
            run = _Eager(graph.gm, fill, keep)
            try:
                run.run(*[a.clone() if isinstance(a, torch.Tensor) and len(fills) > 1 else a for a in args])
            except Exception as e:
                raise EagerFails(f"graph {graph.key[:12]} fails on eager on its build inputs: {type(e).__name__}: {e}") from e
            runs.append(run.values)
    defined = {}
    if len(runs) == 2:
        for n, v in runs[0].items():
            other = runs[1][n]
            if isinstance(v, torch.Tensor) and v.is_floating_point() and not torch.equal(v, other):
                defined[n] = (v == other) | (v.isnan() & other.isnan())
    return Reference(runs[0], defined)


@dataclass(frozen=True)
class Verdict:
    ok: bool
    gap: float        # the worst output's, in the tolerance's measure
    output: str       # its name
    tolerance: Tolerance
    error: str = ""   # the partition failed to run at all

    def stored(self) -> dict:
        """As the disk cache keeps it beside its artifact (JSON: an infinite gap as text)."""
        return {"ok": self.ok, "gap": self.gap if math.isfinite(self.gap) else "inf", "output": self.output,
                "tolerance": [self.tolerance.kind, self.tolerance.bound, self.tolerance.why], "error": self.error}

    @classmethod
    def from_stored(cls, d: dict) -> "Verdict":
        return cls(bool(d["ok"]), float(d["gap"]), str(d["output"]), Tolerance(*d["tolerance"]), str(d["error"]))

    def reason(self) -> str:
        if self.error:
            return f"verify: failed on its build inputs: {self.error}"
        return (f"verify: {self.output} is {self.gap:.3g} off eager ({self.tolerance.kind}), over its "
                f"tolerance {self.tolerance.bound:g} ({self.tolerance.why})")


def check(step: Any, ref: Reference, tolerance: Tolerance) -> Verdict:
    """A delegate partition (a program `Step`) against eager, on the graph's build values."""
    args = [ref.values[n].clone() if isinstance(ref.values[n], torch.Tensor) else ref.values[n] for n in step.inputs]
    try:
        with torch.no_grad():
            outs = step.run(args)
    except Exception as e:  # noqa: BLE001 - any failure of a delegate here declines it
        return Verdict(False, math.inf, "", tolerance, f"{type(e).__name__}: {e}")
    worst = (0.0, "")
    for n, got in zip(step.outputs, outs):
        g = gap(got, ref.values[n], tolerance.kind, ref.defined.get(n))
        if g > worst[0] or not worst[1]:
            worst = (g, n.name) if g >= worst[0] else worst
    return Verdict(not worst[0] > tolerance.bound, worst[0], worst[1], tolerance)


_warned: set = set()  # delegates a user was told of: once each


def declined(delegate: str, verdict: Verdict, graph_key: str, n_ops: int) -> None:
    """Count, report and (once per delegate) warn of a partition the check declined."""
    events.fallback(delegate, verdict.reason(), graph_key, n_ops)
    if delegate not in _warned:
        _warned.add(delegate)
        warnings.warn(f"torchnative: a {delegate} partition of {n_ops} ops gave other values than eager on its build "
                      f"inputs and runs on eager instead ({verdict.reason()}); stats()['fallbacks'] and explain() "
                      f"list each", stacklevel=2)

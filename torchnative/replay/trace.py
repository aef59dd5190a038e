"""The trace of a recorded call: what a replay runs instead of the call's Python.

Python always runs while a call is recorded (DESIGN.md §3); that costs tens of µs per op. A call
of an accelerated module whose recording ran only compiled programs and read only scalars
(`.item()`, `bool()` of a graph value) is described by a `Trace`: which programs ran (a
`GraphCall` each), where each input came from (an argument, an earlier program's output, a
weight), which scalar Python read after which program, and how the outputs were assembled. A
call that cannot be described so raises `Ineligible`, which says why.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any


from torchnative.replay.guard import real
from torchnative.build.program import baked_state

class Ineligible(Exception):
    """This call cannot be described by a trace; the message says why."""


def resolve(src: tuple, leaves: list, produced: list, snapshots: dict) -> Any:
    kind = src[0]
    if kind == "arg":
        return leaves[src[1]]
    if kind == "out":
        return produced[src[1]][src[2]]
    if kind == "field":  # a tensor an argument object holds: where it sits now
        return real(snapshots[src[1]].tensors[src[2]])
    if kind == "view":
        return resolve(src[1], leaves, produced, snapshots).as_strided(*src[2:])
    return src[1]  # "const", "py"


@dataclass(frozen=True)
class GraphCall:
    program: Any                  # build.program.Program
    sources: tuple                # per input: ("arg", i) | ("out", step, j) | ("const", tensor)
                                  # | ("field", i, k): the k-th tensor argument object i holds
                                  # | ("view", source, shape, stride, offset): an alias of a source
    reads: tuple                  # ((j, value), ...): Python read output j as this scalar
    writes: tuple = ()            # sources of the real tensors the trailing values are copied into

    def __post_init__(self) -> None:
        # most inputs are weights ("const"): filled in once, not resolved on every call
        object.__setattr__(self, "_template", [s[1] if s[0] == "const" else None for s in self.sources])
        object.__setattr__(self, "_resolved", [(k, s) for k, s in enumerate(self.sources) if s[0] != "const"])
        # the params the program baked, when the trace holds each as a "const" (it always runs
        # with them): a run checks their versions and addresses alone, in one pass (148 in a GPT-2 step)
        baked = self.program.baked
        held = all(self.sources[i][0] == "const" and self.sources[i][1] is ref() for i, ref, _ in baked)
        object.__setattr__(self, "_baked", ([self.sources[i][1] for i, _, _ in baked], [s for _, _, s in baked]) if held else None)

    def inputs(self, leaves: list, produced: list, snapshots: dict) -> list:
        inputs = self._template.copy()
        for k, s in self._resolved:
            inputs[k] = resolve(s, leaves, produced, snapshots)
        return inputs

    def valid_for(self, inputs: list) -> bool:
        """The program's `valid_for`: its baked params unchanged."""
        if self._baked is None:
            return self.program.valid_for(inputs)
        tensors, states = self._baked
        return list(map(baked_state, tensors)) == states

    def roots(self, leaves: list, produced: list, snapshots: dict) -> list:
        """The real tensors this step's trailing values are copied into."""
        return [resolve(src, leaves, produced, snapshots) for src in self.writes]


@dataclass(frozen=True)
class Trace:
    steps: tuple
    outputs: tuple                # per output leaf: a source, or ("py", value)
    spec: Any                     # the output's pytree structure
    module_changes: int           # module_changes() when the call was recorded
    # ((i, k), source): the k-th tensor argument object i holds is replaced by this value (a
    # DynamicCache's keys by the longer ones the step concatenated)
    sets: tuple = ()

    def held(self, snapshots: dict) -> "Trace":
        """This trace with the tensors argument objects held (at the start of the call these
        snapshots were taken at) as constants: what a bundle saves by identity."""
        def const(src: tuple) -> tuple:
            if src[0] == "field":
                return ("const", real(snapshots[src[1]].tensors[src[2]]))
            return ("view", const(src[1]), *src[2:]) if src[0] == "view" else src

        steps = tuple(replace(s, sources=tuple(map(const, s.sources)), writes=tuple(map(const, s.writes)))
                      for s in self.steps)
        return replace(self, steps=steps, outputs=tuple(map(const, self.outputs)))

    def same_as(self, other: "Trace") -> bool:
        def norm(src):
            return ("const", id(src[1])) if src[0] == "const" else src

        def shape(t: Trace) -> list:
            return [(s.program, tuple(map(norm, s.sources)), s.reads, tuple(map(norm, s.writes))) for s in t.steps]
        mine, theirs = shape(self), shape(other)
        return (mine == theirs and self.spec == other.spec and self.module_changes == other.module_changes
                and [norm(o) for o in self.outputs] == [norm(o) for o in other.outputs] and self.sets == other.sets)

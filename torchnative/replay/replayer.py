"""Replay of a forward proven stable: its compiled programs run without per-op Python work.

A `Replayer` keeps, per accelerated module, the traces (replay/trace.py) its recorded calls made,
by guard key (replay/guard.py: argument structure and metadata, non-tensor arguments, grad mode,
training flag). When two consecutive calls with the same guards produced the same trace, later
calls with those guards replay it: each program runs, each scalar read is checked against the
recorded one, and a mismatch (Python would have branched differently), a changed weight, or a
module attribute set (or a parameter re-registered) anywhere falls back to recording the call — the programs run so far wrote
nothing, so running the call again is safe. Only the last program writes, once every guard held:
into the tensors an argument object reaches, as the recording did.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from torchnative import events
from torchnative.grad import copy_back
from torchnative.lru import Lru
from torchnative.replay.guard import Snapshot, put
from torchnative.replay.trace import Ineligible, Trace, resolve
from torchnative.replay.watch import module_changes
from torchnative.replay.tracer import Tracer


def _run(trace: Trace, leaves: list, snapshots: dict) -> Any:
    """The call's output, or None when a guard fails (then nothing was written)."""
    if trace.module_changes != module_changes():
        return None
    produced: list[list] = []
    for step in trace.steps:
        inputs = step.inputs(leaves, produced, snapshots)
        if not step.valid_for(inputs):
            return None
        values = step.program(inputs)
        events.STATS.graph_runs += 1
        if events.listeners:
            events.emit(events.GraphRun(step.program.graph, True, 0, step.program.partitions, True, step.program))
        for j, expected in step.reads:
            got = values[j].item()
            if type(got) is not type(expected) or got != expected:
                return None
        produced.append(values)
    last = trace.steps[-1] if trace.steps else None
    if last is not None and last.writes:  # only the last step writes, after every guard held
        values = produced[-1]
        copy_back(last.roots(leaves, produced, snapshots), values[len(values) - len(last.writes):])
    out = [resolve(o, leaves, produced, snapshots) for o in trace.outputs]
    for (i, k), src in trace.sets:  # what the call put into its argument objects
        put(snapshots[i].places[k], resolve(src, leaves, produced, snapshots))
    build = trace.__dict__.get("_build")
    if build is None:
        built = pytree.tree_unflatten(out, trace.spec)
        object.__setattr__(trace, "_build", _builder(trace.spec, out, built))
        return built
    return build(out)


def _builder(spec: Any, leaves: list, built: Any) -> Callable[[list], Any]:
    """`pytree.tree_unflatten(·, spec)`, and for a flat transformers ModelOutput something
    cheaper: its dict items and attributes set directly (its __init__ and __post_init__ took 40 us
    of a decode step). Used only when it makes exactly what unflattening made of `leaves`: the
    same items and attributes, each the same object or None; otherwise unflattening it is."""
    unflatten = functools.partial(pytree.tree_unflatten, treespec=spec)
    cls = spec.type
    if spec.is_leaf() or not (issubclass(cls, OrderedDict) and dataclasses.is_dataclass(cls)) \
            or not all(c.is_leaf() for c in spec.children()) or type(built) is not cls:
        return unflatten
    keys = list(spec.context)
    attributes = {}  # attribute -> index of its item, or None
    for name, value in vars(built).items():
        same = [j for j, v in enumerate(leaves) if v is value]
        if value is not None and not same:
            return unflatten  # something __post_init__ derived
        attributes[name] = (keys.index(name) if name in keys else same[0]) if value is not None else None

    def build(values: list) -> Any:
        out = cls.__new__(cls)
        for k, v in zip(keys, values):
            OrderedDict.__setitem__(out, k, v)
        vars(out).update({name: None if j is None else values[j] for name, j in attributes.items()})
        return out

    again = build(leaves)
    same = (list(again.keys()) == list(built.keys()) and all(a is b for a, b in zip(again.values(), built.values()))
            and vars(again).keys() == vars(built).keys() and all(vars(again)[k] is v for k, v in vars(built).items()))
    return build if same else unflatten


@dataclass
class _Entry:
    trace: Trace
    seen: int = 1  # consecutive calls with these guards that recorded this trace
    # consecutive calls (any guards) whose traces were the same as this one, up to its own: a
    # decode step over a growing cache has new guards every call, and the same trace
    run: int = 1


# traces kept per module (a key holds no tensor: replay/guard.py's Snapshot.key): one per decode
# length of a few prompts
_KEEP = 1024


class Replayer:
    """Per accelerated module: guards → trace; a trace replays once seen twice in a row."""

    def __init__(self, weights: frozenset[int]):
        self.weights = weights
        self.entries = Lru(_KEEP, "traces")  # guard key -> _Entry
        self.snapshots: dict[int, Snapshot] = {}  # argument position -> the object last seen there
        self.last: _Entry | None = None  # the entry of the last call recorded

    def is_weight(self, x: torch.Tensor) -> bool:
        return isinstance(x, torch.nn.Parameter) or id(x) in self.weights

    def replay(self, key: tuple, leaves: list) -> tuple[bool, Any]:
        entry = self.entries.get(key)
        if entry is None or (entry.seen < 2 and entry.run < 2):
            return False, None
        out = _run(entry.trace, leaves, self.snapshots)
        if out is None:
            events.STATS.replay_misses += 1
            events.emit(events.ReplayOutcome("miss"))
            return False, None
        events.STATS.replays += 1
        if events.listeners:
            events.emit(events.ReplayOutcome("replayed"))
        return True, out

    def learn(self, key: tuple, tracer: Tracer, leaves: list, out: Any, before: dict) -> None:
        """`before`: the argument objects' snapshots at the call's start (`self.snapshots` holds
        those at its end)."""
        try:
            trace = tracer.trace(leaves, self.is_weight, out, before, self.snapshots)
        except Ineligible as e:
            events.STATS.replay_ineligible[str(e)] += 1
            events.emit(events.ReplayOutcome("ineligible", str(e)))
            self.entries.pop(key, None)
            self.last = None
            return
        run = self.last.run + 1 if self.last is not None and self.last.trace.same_as(trace) else 1
        entry = self.entries.get(key)
        if entry is not None and entry.trace.same_as(trace):
            entry.seen += 1
            entry.trace, entry.run = trace, max(entry.run, run)
        else:
            entry = self.entries[key] = _Entry(trace, run=run)
        self.last = entry

"""Replay of a forward proven stable: its compiled programs run without per-op Python work.

A `Replayer` keeps, per accelerated module, the traces (replay/trace.py) its recorded calls made,
by guard key (replay/guard.py: argument structure and metadata, non-tensor arguments, grad mode,
training flag). When two consecutive calls with the same guards produced the same trace, later
calls with those guards replay it: each program runs, each scalar read is checked against the
recorded one, and a mismatch (Python would have branched differently), a changed weight, or a
module attribute set (or a parameter re-registered) anywhere falls back to recording the call — the programs run so far wrote
nothing, so running the call again is safe. The programs' writes are made at the end, once every guard held:
into the tensors an argument object reaches, as the recording did. A call at sizes never seen
replays the trace whose span covers them (replay/new_sizes.py).
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable

import torch

from torchnative import events
from torchnative.lru import Lru
from torchnative.replay.floats import varied
from torchnative.replay.guard import Snapshot, erased
from torchnative.replay.new_sizes import Span, Spans
from torchnative.replay.trace import Ineligible, Miss, Trace, run
from torchnative.sizes import Flat
from torchnative.replay.tracer import Tracer


@dataclass
class Entry:
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

    def __init__(self, weights: frozenset[int], submit: Callable | None = None, new_sizes: bool = True):
        """`submit`: builds off the call (program_cache.background), for the backward of replays
        autograd records; `new_sizes`: calls at sizes never seen replay a span's trace."""
        self.weights, self.submit = weights, submit
        self.entries = Lru(_KEEP, "traces")  # guard key -> Entry
        self.spans = Spans(_KEEP) if new_sizes else None
        self._flat: tuple[tuple, Flat, tuple | None] | None = None  # the last key erased, its Flat and structure: a call that
        # finds no trace is learnt from once recorded, with the same key
        self.snapshots: dict[int, Snapshot] = {}  # argument position -> the object last seen there
        self.last: Entry | None = None  # the entry of the last call recorded

    def is_weight(self, x: torch.Tensor) -> bool:
        return isinstance(x, torch.nn.Parameter) or id(x) in self.weights

    def find(self, key: tuple) -> tuple[Trace, Span | None] | None:
        """The trace a call with these guards replays: its own, once seen twice in a row, or the
        one whose span covers its sizes; None: the call is recorded."""
        entry = self.entries.get(key)
        if entry is not None and (entry.seen >= 2 or entry.run >= 2):
            return entry.trace, None
        if self.spans is None:
            return None
        flat = self._erased(key)
        span = self.spans.find(flat)
        return (span.trace_at(flat), span) if span is not None else None

    def structure(self, key: tuple) -> tuple:
        """What calls with this guard key share with calls at other sizes: the key without the
        sizes of the tensors it describes, the arguments' and those their objects hold (a decode
        step over a longer cache has the same structure)."""
        self._erased(key)
        if self._flat[2] is None:  # made once per key: a weighed decode step asks on every call
            self._flat = (*self._flat[:2], tuple(self._flat[1].structure))
        return self._flat[2]

    def _erased(self, key: tuple) -> Flat:
        if self._flat is None or self._flat[0] is not key:
            self._flat = (key, erased(key), None)
        return self._flat[1]

    def replay(self, key: tuple, found: tuple[Trace, Span | None], leaves: list, hook_set: tuple = ()) -> tuple[bool, Any]:
        """Run `found` (`find`'s) on the call's arguments. `hook_set`: the model's forward hooks
        now (replay/hooks.hooks_of)."""
        trace, span = found
        out = run(trace, leaves, self.snapshots, self.submit, hook_set)
        if type(out) is Miss:
            events.STATS.replay_misses += 1
            events.emit(events.ReplayOutcome("miss"))
            return False, None
        events.STATS.replays += 1
        if span is not None:
            events.STATS.new_size_replays += 1
        if events.listeners:
            events.emit(events.ReplayOutcome("replayed"))
        if trace.repaid:  # its graph's compile has repaid: the next call records, and compiles it
            self.entries.pop(key, None)
            if span is not None:
                self.spans.drop(self._erased(key), span)
        return True, out

    def learn(self, key: tuple, tracer: Tracer, leaves: list, out: Any, before: dict) -> Entry | None:
        """`before`: the argument objects' snapshots at the call's start (`self.snapshots` holds
        those at its end). The entry the call's trace is in; None: it cannot replay."""
        try:
            trace = tracer.trace(leaves, self.is_weight, out, before, self.snapshots)
        except Ineligible as e:
            events.STATS.replay_ineligible[str(e)] += 1
            events.emit(events.ReplayOutcome("ineligible", str(e)))
            self.entries.pop(key, None)
            self.last = None
            return None
        run = 1
        if self.last is not None and self.last.trace.same_as(trace):
            run, trace = self.last.run + 1, _followed(self.last.trace, trace)
        entry = self.entries.get(key)
        if entry is not None and entry.trace.same_as(trace):
            trace = _followed(entry.trace, trace)
            entry.seen += 1
            entry.trace, entry.run = trace, max(entry.run, run)
        else:
            entry = self.entries[key] = Entry(trace, run=run)
        self.last = entry
        if self.spans is not None:
            self.spans.learn(self._erased(key), trace)
        return entry


def _followed(before: Trace, after: Trace) -> Trace:
    """`after`, a trace the same as `before`, knowing which of the module's dynamic float
    attributes the two calls had at different values (replay/floats.py)."""
    if not after.attrs:
        return after
    return replace(after, varied=varied(before.attrs, after.attrs, before.varied | after.varied))

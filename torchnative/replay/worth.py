"""Whether recording a call that will not replay (or replaying one whose programs all run on
eager) is worth it, or the call runs as plain eager.

Recording costs Python work per op (the door: ~15 µs an op) that eager does not pay. It repays when
the recorded graphs run faster than eager ran them (a delegate's program) or when the calls go on
to replay. A call that cannot replay (DUA's momentum: a Python float that changes every call) and
whose recording took longer than eager runs as eager torch — eager's results by construction. So
does a call that replays, when every program of its trace runs on eager (the cost rule has not
compiled them) and the replay took longer than eager: the recorded graph's Core ATen ops run
through its GraphModule, more of them than the forward's own (a TTT-style scan of small matmuls
replayed at 1.1-1.4x eager's time).

Per call structure — the guard key without the sizes of the tensors it describes, so that BERT at a new length every
call is weighed as one — with the cost rule on (`compile_after=None`) and no `quantize=` (whose outputs are not eager's):
the structure's second
recorded call is timed (its first pays one-time work), the next one that has no trace to replay
runs on eager and is timed, both as seconds per element of the argument tensors (the two calls may
come at other sizes), each side judged by the least of its last _RECENT calls (eager's once it
has two). While recording is the slower by more than _MARGIN, stretches of `gap` calls (4,
doubling to 32) run on eager, each followed by one recorded call that looks again (a compile
finished, the call became replayable); a stretch that began while a graph of the call compiled in
the background ends when a background build finishes. An eager call counts toward the cost rule
as the recorded call's graphs would have run (`CACHE.ran`), so a compile that repays still
happens: the stretch ends, the next call records and compiles. The two recorded calls that make a
trace of compiled programs replay are not weighed (replay/accelerated.py): they would start a
stretch that delays the replays. Counted in `stats()["eager_calls"]`.

A call autograd records is weighed with its backward: a replay's compiled forward can be faster
than eager's while the backward it brings (AOTAutograd's graph run op by op from Python) is slower
than eager autograd's C++ engine (RT-DETR's mean teacher: replays at 0.65x eager's step). Both
sides are timed alike: from the first of the call's output nodes the backward reaches to the end
of that backward (`_time_backward`). Until then the call's sample is pending and nothing is
judged by it; a call that starts before its predecessor's backward ran counts that one as
forward alone (inference with grad on, no backward).
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from torchnative import events
from torchnative.cache.program_cache import CACHE, compiles_finished
from torchnative.lru import Lru

_MARGIN = 1.1
_FIRST_GAP, _MAX_GAP = 4, 32
_RECENT = 3
_EAGER_SAMPLES = 2
_KEEP = 1024  # as the replayer's traces: keys hold no tensor


@dataclass
class _Sample:
    seconds: float          # per argument element: the forward, and its backward once it ran
    pending: bool = False   # its backward may yet run
    decides: bool = False   # judge the costs again when it is no longer pending


@dataclass
class _Costs:
    # `_Sample`s of the last warm recorded (or weighed replayed) calls, and of the last eager calls:
    # each side judged by its least (a call slowed by something else beside it, a compile, another
    # process, would otherwise decide alone)
    recent_recorded: deque = field(default_factory=lambda: deque(maxlen=_RECENT))
    recent_eager: deque = field(default_factory=lambda: deque(maxlen=_RECENT))
    calls: int = 0                 # recorded calls
    skip: int = 0                  # eager calls left in this stretch
    gap: int = _FIRST_GAP          # the next stretch's length
    credit: tuple = ()             # (cost-rule key, seconds): the last recorded call's graph runs on eager
    waits: int | None = None       # compiles_finished() when the last recorded call waited on a compile

    @property
    def recorded(self) -> float | None:
        return min((s.seconds for s in self.recent_recorded if not s.pending), default=None)

    @property
    def eager(self) -> float | None:
        return min((s.seconds for s in self.recent_eager if not s.pending), default=None)

    def settle(self) -> None:
        """A new call starts: a backward that has not run by now is not this call's to wait for."""
        for sample in (*self.recent_recorded, *self.recent_eager):
            if sample.pending:
                self.done(sample)

    def done(self, sample: _Sample) -> None:
        sample.pending = False
        if sample.decides:
            sample.decides = False
            _decide(self)

    def add(self, recent: deque, seconds: float, elements: int, out: Any, decides: bool) -> None:
        sample = _Sample(seconds / elements)
        recent.append(sample)

        def backward_took(spent: float) -> None:
            sample.seconds += spent / elements
            if sample.pending:
                self.done(sample)
        sample.pending = _time_backward(out, backward_took)
        sample.decides = decides and sample.pending
        if decides and not sample.pending:
            _decide(self)


class Worth:
    """Per accelerated module: call structure (Replayer.structure) → the costs of its calls
    recorded and run on eager."""

    def __init__(self) -> None:
        self.keys = Lru(_KEEP, "call costs")

    def eager_next(self, key: tuple) -> bool:
        """Should the call of this structure run on eager?"""
        c = self.keys.get(key)
        if c is None:
            return False
        c.settle()
        if c.waits is not None and c.waits != compiles_finished():  # its program may be ready: look
            c.skip, c.waits = 0, None
        if any(CACHE.repaid(run_key) for run_key, _ in c.credit):  # a compile repaid: the call records, to compile it
            c.skip = 0
            return False
        # eager is timed twice before it is weighed: a module's first eager call may pay one-time
        # work (seen: 7.7 ms for a 0.1 ms MLP), which would then decide for recording for good
        return c.skip > 0 or (len(c.recent_eager) < _EAGER_SAMPLES and c.recorded is not None)

    def ran_eager(self, key: tuple, seconds: float, elements: int, out: Any) -> None:
        """An eager call of `elements` argument elements took `seconds`; `out`: its outputs, whose
        backward, if autograd recorded them, is timed too."""
        c = self.keys[key]
        if events.listeners:
            ratio = f"{c.recorded / c.eager:.1f}x" if c.recorded is not None and c.eager is not None else "more than"
            events.emit(events.ReplayOutcome("eager", f"ran as eager: recording or replaying it took {ratio} eager's "
                                                      f"time (replay/worth.py)"))
        measures = c.skip == 0  # the call that measures eager: judged by when its sample is complete
        if c.skip > 0:
            c.skip -= 1
        c.add(c.recent_eager, seconds, elements, out, measures)
        for run_key, spent in c.credit:  # once its compile repays, the next call records (eager_next)
            CACHE.ran(run_key, spent)
        events.STATS.eager_calls += 1

    def recorded(self, key: tuple, seconds: float, elements: int, credit: list, compiling: bool, out: Any) -> None:
        """A recorded (or weighed replayed) call of `elements` argument elements took `seconds`;
        `credit`: (cost-rule key, seconds) of its graphs' runs on eager; `compiling`: one of them
        ran on eager while its program compiles in the background; `out`: its outputs."""
        c = self.keys.get(key)
        if c is None:
            c = self.keys[key] = _Costs()
        c.calls += 1
        if c.calls == 1:
            return
        c.credit = tuple(credit)
        c.waits = compiles_finished() if compiling else None
        c.add(c.recent_recorded, seconds, elements, out, True)


def _decide(c: _Costs) -> None:
    if c.recorded is None or c.eager is None:
        return
    if c.recorded > _MARGIN * c.eager:
        c.skip, c.gap = c.gap, min(2 * c.gap, _MAX_GAP)
    else:
        c.skip, c.gap = 0, _FIRST_GAP


def _time_backward(out: Any, took: Callable[[float], None]) -> bool:
    """Time the backward of `out`'s tensors that autograd recorded, from the first of their nodes it
    reaches to its end, and give `took` the seconds. Are there any?"""
    nodes = {id(t.grad_fn): t.grad_fn for t in pytree.tree_leaves(out)
             if isinstance(t, torch.Tensor) and t.grad_fn is not None}
    if not nodes:
        return False
    started: list = []

    def reached(grad_outputs: tuple) -> None:
        if not started:
            started.append(time.perf_counter())
            torch.autograd.Variable._execution_engine.queue_callback(
                lambda: took(time.perf_counter() - started[0]))
    for node in nodes.values():
        node.register_prehook(reached)
    return True

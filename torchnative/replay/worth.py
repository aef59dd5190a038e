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

Per call structure — the guard key without its tensors' sizes, so that BERT at a new length every
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
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from torchnative import events
from torchnative.cache.program_cache import CACHE, compiles_finished
from torchnative.lru import Lru

_MARGIN = 1.1
_FIRST_GAP, _MAX_GAP = 4, 32
_RECENT = 3
_EAGER_SAMPLES = 2
_KEEP = 1024  # as the replayer's traces: keys hold no tensor


@dataclass
class _Costs:
    # seconds per argument element of the last warm recorded (or eager-only replayed) calls, and
    # of the last eager calls: each judged by its least (a call slowed by something else beside
    # it, a compile, another process, would otherwise decide alone)
    recent_recorded: deque = field(default_factory=lambda: deque(maxlen=_RECENT))
    recent_eager: deque = field(default_factory=lambda: deque(maxlen=_RECENT))
    calls: int = 0                 # recorded calls
    skip: int = 0                  # eager calls left in this stretch
    gap: int = _FIRST_GAP          # the next stretch's length
    credit: tuple = ()             # (cost-rule key, seconds): the last recorded call's graph runs on eager
    waits: int | None = None       # compiles_finished() when the last recorded call waited on a compile

    @property
    def recorded(self) -> float | None:
        return min(self.recent_recorded, default=None)

    @property
    def eager(self) -> float | None:
        return min(self.recent_eager, default=None)


class Worth:
    """Per accelerated module: call structure (guard.sizes_erased) → the costs of its calls
    recorded and run on eager."""

    def __init__(self) -> None:
        self.keys = Lru(_KEEP, "call costs")

    def eager_next(self, key: tuple) -> bool:
        """Should the call of this structure run on eager?"""
        c = self.keys.get(key)
        if c is None:
            return False
        if c.waits is not None and c.waits != compiles_finished():  # its program may be ready: look
            c.skip, c.waits = 0, None
        # eager is timed twice before it is weighed: a module's first eager call may pay one-time
        # work (seen: 7.7 ms for a 0.1 ms MLP), which would then decide for recording for good
        return c.skip > 0 or (len(c.recent_eager) < _EAGER_SAMPLES and c.recorded is not None)

    def ran_eager(self, key: tuple, seconds: float, elements: int) -> None:
        c = self.keys[key]
        c.recent_eager.append(seconds / elements)
        if events.listeners:
            events.emit(events.ReplayOutcome("eager", f"ran as eager: recording it took {c.recorded / c.eager:.1f}x "
                                                      f"eager's time and it does not replay, or replays on eager "
                                                      f"programs alone (replay/worth.py)"))
        if c.skip > 0:
            c.skip -= 1
        else:  # the call that measured eager
            self._decide(c)
        for run_key, spent in c.credit:
            if CACHE.ran(run_key, spent):  # its compile repays: the next call records, and compiles it
                c.skip = 0
        events.STATS.eager_calls += 1

    def recorded(self, key: tuple, seconds: float, elements: int, credit: list, compiling: bool) -> None:
        """A recorded call of `elements` argument elements took `seconds`; `credit`: (cost-rule
        key, seconds) of its graphs' runs on eager; `compiling`: one of them ran on eager while its
        program compiles in the background."""
        c = self.keys.get(key)
        if c is None:
            c = self.keys[key] = _Costs()
        c.calls += 1
        if c.calls == 1:
            return
        c.recent_recorded.append(seconds / elements)
        c.credit = tuple(credit)
        c.waits = compiles_finished() if compiling else None
        if c.eager is not None:
            self._decide(c)

    @staticmethod
    def _decide(c: _Costs) -> None:
        if c.recorded > _MARGIN * c.eager:
            c.skip, c.gap = c.gap, min(2 * c.gap, _MAX_GAP)
        else:
            c.skip, c.gap = 0, _FIRST_GAP

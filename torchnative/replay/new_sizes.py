"""Replay at sizes never seen: a decode step over a cache one token longer, a prompt of a new length.

A trace recorded at one size names the same programs, sources and reads as the trace of the same
call at another size once every program in it stands for every size (a template's,
cache/templates.py) — consecutive decode steps make one trace. Each such trace is a `Span`: the
rules that take its calls' argument sizes from one to another (torchnative.sizes, fitted on the
guard keys as `guard.erased` flattens them: a mask one longer than the cache stays one longer),
and the range of each size it was recorded at. A call at a new size replays it when its sizes
follow the rules and lie within that range.

Why within, and what a Python branch on a size does: a replay does not run the forward's Python,
so it cannot see a branch. A branch that takes one side up to some size and the other beyond it
(`if kv_len > sliding_window`) records another trace past that size; a size beyond every size
recorded with a trace is recorded, never replayed, so the replay never crosses such a branch. A
recording at a size inside a span that made another trace (a branch that flips and flips back,
`if n % 64 == 0`) breaks the span for good, and the call it came from was recorded, so its result
is eager's; a size inside a span that no call ever recorded, on the far side of such a branch,
would replay the span's trace. `accelerate(model, replay_new_sizes=False)` records every size
never seen (the replay then needs the same sizes twice), for code that branches on sizes so.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from torchnative.lru import Lru
from torchnative.replay.trace import Trace
from torchnative.sizes import Flat, Rule, Sizes, fit, relate

# recordings of a trace at distinct sizes before a new size replays it: two fit the rules, the
# third confirms them (as a template is confirmed)
CONFIRMED = 3
_PER_STRUCTURE = 4  # spans kept per argument structure (a prefill's and a decode step's are two structures)


@dataclass(eq=False)
class Span:
    trace: Trace
    flat: Flat                        # the sizes it was last recorded at
    sizes: Sizes | None = None        # the rules, once recorded at two sizes
    low: list[int] = field(default_factory=list)   # per symbol: the least value recorded
    high: list[int] = field(default_factory=list)  # and the greatest
    recorded: int = 1                 # distinct sizes recorded, following the rules
    broken: bool = False              # a size inside it recorded another trace
    # the integers of the views Python took of its values (`out.view(b, n, V)`: Trace.view_ints)
    # at `flat`, and once recorded at two sizes, the rule of each in the symbols
    views: list[int] = field(default_factory=list)
    view_rules: list[Rule] = field(default_factory=list)
    # (trace, its views' integers, the trace at them): the last `trace_at`, which a decode step's
    # replays ask again and again (its views the same at every length); made anew, a trace builds
    # its outputs' builder again at its first run (replay/trace.py)
    made: tuple | None = None

    def values(self, flat: Flat) -> list[int] | None:
        """The symbols' values at `flat`'s sizes, if they follow the rules."""
        return self.sizes.match(flat) if self.sizes is not None else None

    def covers(self, flat: Flat) -> bool:
        values = self.values(flat)
        return values is not None and all(lo <= v <= hi for v, lo, hi in zip(values, self.low, self.high))

    def trace_at(self, flat: Flat) -> Trace:
        """Its trace at `flat`'s sizes (which it covers): the views' integers from their rules."""
        values = self.values(flat)
        ints = [r.value(values) for r in self.view_rules]
        if self.made is None or self.made[0] is not self.trace or self.made[1] != ints:
            self.made = (self.trace, ints, self.trace.with_view_ints(ints))
        return self.made[2]

    def widen(self, flat: Flat, views: list[int]) -> None:
        """The trace recorded again at `flat`'s sizes, its views' integers `views`. Views whose
        integers break their rules (fitted on a coincidence) start the span over: a size the
        span covers replays views of the sizes its rules give."""
        if flat.ints == self.flat.ints:
            return
        if self.sizes is None:
            self.sizes = fit(self.flat, flat)
            if self.sizes is not None:
                before, after = (self.sizes.match(f) for f in (self.flat, flat))
                rules = _view_rules(self.views, views, before, after) if before and after else None
                if rules is None:  # rules no sample follows: fitted on a coincidence
                    self.sizes = None
                else:
                    self.low, self.high = list(map(min, before, after)), list(map(max, before, after))
                    self.recorded, self.view_rules = 2, rules
            self.flat, self.views = flat, views
            return
        values = self.sizes.match(flat)
        if values is None:
            return
        if [r.value(values) for r in self.view_rules] != views:
            self.sizes, self.recorded, self.view_rules, self.low, self.high = None, 1, [], [], []
            self.flat, self.views = flat, views
            return
        self.low, self.high = list(map(min, self.low, values)), list(map(max, self.high, values))
        self.recorded += 1
        self.flat, self.views = flat, views


def _view_rules(a: list[int], b: list[int], before: list[int], after: list[int]) -> list[Rule] | None:
    """Each view integer's rule in the symbols (values `before` at `a`, `after` at `b`), or None
    where one follows none."""
    rules = [Rule(y) if x == y else relate(x, y, before, after) for x, y in zip(a, b)]
    return rules if len(a) == len(b) and None not in rules else None


class Spans:
    """Per argument structure (`Flat.structure`), the spans of the traces its calls recorded."""

    def __init__(self, limit: int):
        self.spans = Lru(limit, "size spans")

    def learn(self, flat: Flat, trace: Trace) -> None:
        """A call at `flat`'s sizes recorded `trace`. One autograd records has no span: the
        backward of its programs is traced at the sizes it was recorded at (build/differentiable.py)."""
        if any(c.differentiable for c in trace.calls):
            return
        spans = self.spans.setdefault(_key(flat), [])
        # a trace whose eager program was compiled since is no longer what these sizes run
        spans[:] = [s for s in spans if not s.trace.superseded()]
        same = next((s for s in spans if s.trace.same_as(trace, sizes=False)), None)
        for s in spans:
            if s is not same and s.covers(flat):
                s.broken = True  # a size inside it made another trace: a branch on a size
        views = trace.view_ints()
        if same is None:
            spans.append(Span(trace, flat, views=views))
            del spans[:-_PER_STRUCTURE]
            return
        same.trace = trace  # the same, with the latest tensors it holds by identity
        same.widen(flat, views)

    def find(self, flat: Flat) -> Span | None:
        """The span whose trace a call at `flat`'s sizes replays, if exactly one covers them."""
        spans = self.spans.get(_key(flat))
        if not spans:
            return None
        found = [s for s in spans if s.recorded >= CONFIRMED and not s.broken and s.covers(flat)]
        return found[0] if len(found) == 1 else None

    def drop(self, flat: Flat, span: Span) -> None:
        spans = self.spans.get(_key(flat))
        if spans is not None and span in spans:
            spans.remove(span)


def _key(flat: Flat) -> tuple:
    return tuple(flat.structure)

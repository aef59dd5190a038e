"""Counters and events that the layers emit and the inspector listens to.

Counters are always kept. Events go to listeners; with none registered (the default) `emit` is a
loop over an empty list, and per-partition timing (`PartitionRun`) is not even measured unless
`timing` is on, which `torchnative.profile()` turns on for its block."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable


@dataclass(frozen=True)
class GraphBreak:
    reason: str
    op: str
    filename: str
    line: int


@dataclass(frozen=True)
class GraphRun:
    graph: Any           # CapturedGraph
    cache_hit: bool
    n_ops_recorded: int
    partitions: tuple = ()   # ((delegate, n_ops), ...) in execution order
    replayed: bool = False   # run from a replay trace, without recording
    program: Any = None      # build.program.Program: its steps and declined nodes
    not_compiled: str = ""   # why it ran on eager though delegates were asked for


@dataclass(frozen=True)
class Fallback:
    delegate: str
    reason: str
    graph_key: str = ""
    n_ops: int = 0


@dataclass(frozen=True)
class ProgramBuilt:
    """A graph was partitioned and each partition compiled."""
    program: Any               # build.program.Program
    seconds: float


@dataclass(frozen=True)
class Partitioned:
    """A graph was split over delegates; its partitions compile next."""
    graph_key: str
    partitions: tuple          # ((delegate, n_ops), ...) in execution order


@dataclass(frozen=True)
class PartitionLowered:
    """One partition of a program being built has its artifact (or is left to eager); loading
    its runner comes next (PartitionCompiled)."""
    graph_key: str
    index: int
    total: int                 # partitions in this program


@dataclass(frozen=True)
class PartitionCompiled:
    """One partition of a program being built is ready: its runner loaded (or left to eager)."""
    step: Any                  # build.program.Step
    graph_key: str
    index: int
    total: int                 # partitions in this program


@dataclass(frozen=True)
class PartitionRun:
    """One partition ran (emitted only while `timing` is on); start is `time.perf_counter()`."""
    step: Any                  # build.program.Step
    graph_key: str
    index: int
    start: float
    seconds: float


@dataclass(frozen=True)
class Pinned:
    """A tensor was pinned: by `torchnative.pin`, or because it changed between two runs."""
    label: str
    reason: str


@dataclass(frozen=True)
class ReplayOutcome:
    outcome: str               # "replayed", "miss" (a guard failed), "ineligible" or "eager" (replay/worth.py)
    reason: str = ""


@dataclass
class Stats:
    ops_recorded: int = 0
    graphs_built: int = 0
    cache_hits: int = 0
    cache_misses: int = 0
    graph_runs: int = 0
    syncs: Counter = field(default_factory=Counter)
    fallbacks: Counter = field(default_factory=Counter)
    replays: int = 0                      # calls run from a trace, without recording
    new_size_replays: int = 0             # of those, calls at sizes never seen (replay/new_sizes.py)
    replay_misses: int = 0                # a trace's guard failed; the call was recorded
    replay_ineligible: Counter = field(default_factory=Counter)  # why a call cannot be replayed
    pinned: dict = field(default_factory=dict)          # tensor label -> why it is pinned
    quantized: Counter = field(default_factory=Counter)  # "scheme: quantized" or why a weight was not
    folded: int = 0                       # values computed from weights alone when a program was built
    fused: Counter = field(default_factory=Counter)  # composite -> matches fused into partitions compiled
    disk_cache: Counter = field(default_factory=Counter)  # compiled partitions: hits, misses, writes, corrupt
    compiling_runs: int = 0               # graph runs on eager while their program compiled in the background
    not_compiled: Counter = field(default_factory=Counter)  # graph runs left on eager by the cost rules, by rule
    symbolic_graphs: int = 0              # graphs made to stand for every size (torchnative.sizes)
    evicted: Counter = field(default_factory=Counter)  # entries a bounded table dropped (torchnative.lru), by table
    eager_calls: int = 0                  # accelerated calls run as eager: recording them cost more (replay/worth.py)

    def as_dict(self) -> dict:
        return {"ops_recorded": self.ops_recorded, "graphs_built": self.graphs_built,
                "cache_hits": self.cache_hits, "cache_misses": self.cache_misses,
                "graph_runs": self.graph_runs, "syncs": dict(self.syncs),
                "fallbacks": dict(self.fallbacks), "replays": self.replays, "new_size_replays": self.new_size_replays,
                "replay_misses": self.replay_misses, "replay_ineligible": dict(self.replay_ineligible),
                "pinned": dict(self.pinned), "quantized": dict(self.quantized), "folded": self.folded,
                "fused": dict(self.fused), "disk_cache": dict(self.disk_cache), "compiling_runs": self.compiling_runs,
                "not_compiled": dict(self.not_compiled), "symbolic_graphs": self.symbolic_graphs,
                "evicted": dict(self.evicted), "eager_calls": self.eager_calls}


STATS = Stats()
timing = False  # measure each partition's run (PartitionRun); costs two clock reads per partition
_listeners: list[Callable[[Any], None]] = []
listeners = _listeners  # the same list: a hot path that builds an event asks it first


def emit(event: Any) -> None:
    for fn in _listeners:
        fn(event)


def listen(fn: Callable[[Any], None]) -> Callable[[], None]:
    """Register `fn` for every event; returns a function that unregisters it."""
    _listeners.append(fn)
    return lambda: _listeners.remove(fn)


def fallback(delegate: str, why: str, graph_key: str, n_ops: int) -> None:
    """A partition runs on eager instead of its delegate: counted and reported, never silent."""
    STATS.fallbacks[f"{delegate}: {why.splitlines()[0][:200] if why else ''}"] += 1
    emit(Fallback(delegate, why, graph_key, n_ops))

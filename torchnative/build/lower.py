"""Lowering, the stage between the partitioner and loading (ExecuTorch's `preprocess`): a prepared
graph → its `Plan` (from the disk cache when an earlier process made it) → one `Lowered`
partition each, holding its delegate's artifact (from the disk cache, else compiled) or the
reason it runs on eager."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.fx as fx

from torchnative import events, store
from torchnative.delegates.base import in_clean_thread
from torchnative.interface import Artifact, Delegate
from torchnative.ir import CapturedGraph
from torchnative.partitioner import EAGER, Plan, Subgraph, extract, partition, written_back
from torchnative.passes.fuse import fuse
from torchnative.build import apart, disk_cache
from torchnative.quiet import quiet


@dataclass
class Lowered:
    """One partition: its graph, and the artifact its delegate compiled (None on eager)."""
    delegate: str
    part: Subgraph
    artifact: Artifact | None = None
    cache_entry: str | None = None  # the disk cache entry the artifact came from or went to
    from_cache: bool = False  # it came from there (an earlier process stored it)
    seconds: float = 0.0


@dataclass
class LoweredGraph:
    partitions: list[Lowered]  # in execution order; empty: the whole graph runs on eager
    declined: tuple = ()  # (op, delegate, reason) of every node a delegate declined
    delegates: dict[str, Delegate] = field(default_factory=dict)


# delegate partitions a graph may split into and still be compiled. RT-DETR's backward (AOTAutograd's,
# 1064 ops, for ActMAD's training-mode replays) split into 129 ONNX Runtime partitions around the
# convolution_backward ops it leaves to eager: ~100 s of compiles off the call, and the program ran
# slower than its graph on eager (68 against 63 ms); its forward's 30 partitions compile in ~27 s
MAX_PIECES = 64


def lower(graph: CapturedGraph, delegates: Sequence[Delegate], inputs: list[torch.Tensor],
          calibration_sets: Sequence[list[torch.Tensor]] = ()) -> LoweredGraph:
    """`inputs`: the prepared graph's placeholders' values; `calibration_sets`: more of them, for
    delegates that calibrate on values."""
    if not any(d.name != EAGER for d in delegates) or not graph.op_nodes():
        return LoweredGraph([])
    plan = _plan(graph, delegates)
    declined = _declined(graph, plan.declined)
    if all(p.delegate == EAGER for p in plan.partitions):
        return LoweredGraph([], declined)
    pieces = [p for p in plan.partitions if p.delegate != EAGER]
    if len(pieces) > MAX_PIECES:
        n_ops = len(graph.op_nodes())
        names = "+".join(sorted({p.delegate for p in pieces}))
        events.fallback(names, f"the graph splits into {len(pieces)} {names} partitions between ops no delegate takes "
                               f"(more than {MAX_PIECES}): their compiles (~0.25 s each) would not repay, and every "
                               "boundary moves its values; the graph runs on eager", graph.key, n_ops)
        return LoweredGraph([], declined)
    samples = None
    if any(getattr(d, "calibrates", False) for d in delegates):
        samples = [_sample_values(graph, s) for s in (inputs, *calibration_sets)]
    only_written_back = written_back(graph)
    events.emit(events.Partitioned(graph.key, tuple((p.delegate, len(p.nodes)) for p in plan.partitions)))
    by_name = {d.name: d for d in delegates}
    lowered = []
    for i, p in enumerate(plan.partitions):
        part = extract(graph, p, inputs, only_written_back, samples)
        lowered.append(_lower(by_name[p.delegate], part, graph.key) if p.delegate != EAGER else Lowered(EAGER, part))
        events.emit(events.PartitionLowered(graph.key, i, len(plan.partitions)))
    return LoweredGraph(lowered, declined, by_name)


def _lower(delegate: Delegate, part: Subgraph, graph_key: str) -> Lowered:
    started = time.perf_counter()
    try:
        artifact, entry, from_cache = in_clean_thread(artifact_of, delegate, part.graph)
    except Exception as e:  # compile failure: this partition runs eagerly, and we say so
        n_ops = len(part.graph.op_nodes())
        events.fallback(delegate.name, f"compile failed for {n_ops} op(s): {type(e).__name__}: {e}", graph_key, n_ops)
        return Lowered(EAGER, part)
    return Lowered(delegate.name, part, artifact, entry, from_cache, time.perf_counter() - started)


def artifact_of(delegate: Delegate, graph: CapturedGraph, cached: bool = True) -> tuple[Artifact, str | None, bool]:
    """From the disk cache (unless not `cached`), else compiled (and stored); with its cache entry
    (None without a disk cache) and whether it came from there."""
    entry = disk_cache.key(delegate, graph) if store.place() is not None else None
    artifact = disk_cache.get(entry, delegate.name, graph.constants) if entry and cached else None
    if artifact is not None:
        return artifact, entry, True
    with quiet():  # the toolchain's notes; the user's, from other threads meanwhile, pass
        def compile_() -> Artifact:
            return delegate.compile(fuse(graph, delegate.composites))
        artifact = apart.compiled(compile_, graph.constants) if apart.wanted() else None
        if artifact is None:
            artifact = compile_()
    if entry:
        disk_cache.put(entry, artifact)
    return artifact, entry, False


def _plan(graph: CapturedGraph, delegates: Sequence[Delegate]) -> Plan:
    """The partitioning, from the disk cache when an earlier process made it."""
    entry = disk_cache.plan_key(graph, delegates) if store.place() is not None else None
    plan = disk_cache.get_plan(entry, graph.gm.graph) if entry else None
    if plan is None:
        plan = partition(graph.gm.graph, delegates)
        if entry:
            disk_cache.put_plan(entry, plan)
    return plan


def _declined(graph: CapturedGraph, declined: dict) -> tuple:
    target = {n.name: str(n.target) for n in graph.op_nodes()}
    return tuple((target.get(name, name), d, why) for name, reasons in declined.items() for d, why in reasons)


def _sample_values(graph: CapturedGraph, inputs: list[torch.Tensor]) -> dict[fx.Node, object]:
    """Every node's value on the inputs the graph was built for (one eager run): calibration
    data for delegates that quantize activations."""
    seen: dict[fx.Node, object] = {}

    class _Keep(fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]

    with torch.no_grad():
        _Keep(graph.gm).run(*inputs)
    return seen

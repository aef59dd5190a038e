"""Loading, the stage after lowering: each lowered partition's artifact → its delegate's runner,
as a program `Step`. An artifact from the disk cache that fails to load is discarded and compiled
again; a compile-only delegate's partition (Core ML on Linux) keeps its artifact and runs on eager
here, with the reason."""
from __future__ import annotations

import time
from typing import Callable

from torchnative import events
from torchnative.delegates.base import in_clean_thread
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Artifact, CompileOnly, Delegate
from torchnative.ir import is_weight
from torchnative.partitioner import EAGER
from torchnative.build import disk_cache
from torchnative.build.lower import Lowered, LoweredGraph, artifact_of
from torchnative.build.program import Step
from torchnative.quiet import quiet


def runners(lowered: LoweredGraph, graph_key: str, keep_artifacts: bool = False) -> list[Step]:
    """`keep_artifacts`: each step keeps its delegate's artifact, to be saved in a bundle."""
    steps = []
    for i, part in enumerate(lowered.partitions):
        step = None
        if part.delegate != EAGER:
            step = _step(lowered.delegates[part.delegate], part, graph_key, keep_artifacts)
        if step is None:
            step = eager_step(part)
        events.emit(events.PartitionCompiled(step, graph_key, i, len(lowered.partitions)))
        steps.append(step)
    return steps


def eager_step(part: Lowered) -> Step:
    sub = part.part
    return Step(EAGER, sub.graph, sub.reads, sub.reads, sub.outputs, eager.load(eager.compile(sub.graph)))


def _step(delegate: Delegate, part: Lowered, graph_key: str, keep: bool) -> Step | None:
    sub = part.part
    started = time.perf_counter()
    try:
        run, compile_only, artifact = in_clean_thread(_runner, delegate, part)
    except Exception as e:  # a fresh artifact that does not load: this partition runs eagerly, and we say so
        n_ops = len(sub.graph.op_nodes())
        events.fallback(delegate.name, f"compile failed for {n_ops} op(s): {type(e).__name__}: {e}", graph_key, n_ops)
        return None
    runtime_inputs = [n for n, role in zip(sub.reads, sub.graph.input_roles) if not is_weight(role)]
    name = delegate.name
    if run is None:  # built for a device this machine is not: eager runs it here
        events.fallback(name, f"compile-only on this platform: {compile_only}", graph_key, len(sub.graph.op_nodes()))
        run, runtime_inputs, name = eager.load(eager.compile(sub.graph)), sub.reads, EAGER
    return Step(name, sub.graph, sub.reads, runtime_inputs, sub.outputs, run,
                part.seconds + time.perf_counter() - started, len(artifact.payload), artifact if keep else None,
                entry=part.cache_entry)


def _runner(delegate: Delegate, part: Lowered) -> tuple[Callable | None, str, Artifact]:
    """The runner (None for a compile-only delegate, with its reason) and the artifact it runs."""
    try:
        return (*_load(delegate, part.artifact), part.artifact)
    except Exception:
        if not part.from_cache:
            raise
        disk_cache.discard(part.cache_entry)
    artifact, *_ = artifact_of(delegate, part.part.graph, cached=False)
    return (*_load(delegate, artifact), artifact)


def _load(delegate: Delegate, artifact: Artifact) -> tuple[Callable | None, str]:
    try:
        with quiet():
            return delegate.load(artifact), ""
    except CompileOnly as e:
        return None, str(e)

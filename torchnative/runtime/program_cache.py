"""Compiled programs in memory, by graph key and guards (baked params' identity and version): the
program for a recorded graph, built on a miss once the graph has run `compile_after` times (in a
background thread, the graph running on eager until it is ready, or in the call), and a weight
written between two runs pinned from then on."""
from __future__ import annotations

import os
import sys
import threading
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from torchnative import events
from torchnative.recording import reset as forget_recordings
from torchnative.recording.trie import TrieNode, Signature, build_graph
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Delegate
from torchnative.passes.pin import pin
from torchnative.runtime import calibration
from torchnative.runtime.pipeline import build_program
from torchnative.runtime.program import Program, baked_state

_FLOAT_UNDER_AUTOGRAD = "not quantized: autograd records the graph (run under torch.no_grad() to quantize)"


def _under_autograd(inputs: list[torch.Tensor]) -> bool:
    """Autograd records this graph's ops above the door, saving the float weights, and a backward
    runs on those: a quantized forward would get another function's gradients (TENT would adapt
    to a model it does not run). Such graphs stay float, and the user is told once."""
    if not (torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad for t in inputs)):
        return False
    warnings.warn("torchnative: quantize= leaves the graphs autograd records in float32 (their backward "
                  "would use the float weights); run inference under torch.no_grad() to quantize", stacklevel=2)
    return True


# runs of a graph on eager before it is compiled: compiling for a delegate costs seconds, and a
# graph seen once (a new shape at every decode step) would never repay it
COMPILE_AFTER = 2
_programs: dict = {}
_runs: dict = {}  # (graph key, delegates) -> runs so far, for compile_after

# compiles off the critical path: one at a time (two cores: a second compile would take the
# call's), on a thread of their own, whose dispatch state is fresh as tracing compilers need.
# Opt-in: torch.export keeps some state per process (its pre-dispatch modes: shim.door's
# no_dispatch_modes keeps the door off it), and not all of it has been audited for a second thread.
BACKGROUND = os.environ.get("TORCHNATIVE_BACKGROUND_COMPILE", "0") == "1"
_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchnative-compile-background")
# at exit, compiles not started are dropped (the one running finishes: a thread cannot be stopped).
# threading's exit hooks run in reverse order, so this one runs before the executor's own joins.
threading._register_atexit(lambda: _background.shutdown(wait=False, cancel_futures=True))
_building: dict = {}  # program key -> (Future of the Program, inputs and their states when submitted)
# A call's ops release the GIL in each kernel; the compile thread takes it and keeps it until the
# switch interval runs out (5 ms): every op of the call waited that long (a ResNet-50 TENT step of
# 1.6 s took 17 s while ONNX export ran). A short interval while a compile runs bounds the wait.
_SWITCH_WHILE_COMPILING = 1e-4
_switch = sys.getswitchinterval()
_unfinished = [0]
_unfinished_lock = threading.Lock()


def _submit(*args, **kwargs) -> Future:
    with _unfinished_lock:
        _unfinished[0] += 1
        sys.setswitchinterval(_SWITCH_WHILE_COMPILING)
    job = _background.submit(*args, **kwargs)
    job.add_done_callback(_finished)
    return job


def _finished(_: Future) -> None:
    with _unfinished_lock:
        _unfinished[0] -= 1
        if not _unfinished[0]:
            sys.setswitchinterval(_switch)


class Found(NamedTuple):
    program: Program
    hit: bool        # from the cache, not built for this call
    stand_in: bool   # eager's program, run while the delegates' one compiles in the background


def program_for(node: TrieNode, sig: Signature, delegates: tuple[Delegate, ...], inputs: list[torch.Tensor],
                compile_after: int, quantize: str | None = None, background: bool = False) -> Found:
    """The compiled program for this graph key and these guards (baked params' identity and
    version), building it on a miss. Until the graph has run `compile_after` times it runs on
    eager alone: compiling for a delegate costs seconds, and a graph seen once (a new shape at
    every decode step) would never repay it. With `background`, a miss starts the build on the
    background thread and the graph runs on eager's program until the build is done."""
    if calibration.active():  # the graph runs on eager, its inputs kept for the program built later
        calibration.keep((node, sig), inputs)
        delegates = (eager,)
    elif compile_after > 1 and delegates != (eager,):
        seen = _runs[node, sig, delegates] = _runs.get((node, sig, delegates), 0) + 1
        if seen < compile_after:
            delegates = (eager,)
    differentiated = quantize is not None and _under_autograd(inputs)
    if differentiated:
        quantize = None
    key = (node, sig, delegates, quantize)
    candidates = _programs.get(key)
    if candidates is None:
        candidates = _programs[key] = []
    if key in _building:
        _adopt(key, candidates)
    for p in candidates:
        if p.valid_for(inputs):
            events.STATS.cache_hits += 1
            return Found(p, True, False)
    for p in candidates:  # a weight written between two runs of this graph is updated at test time
        for t in p.changed(inputs):
            pin(t, f"written between two runs of graph {p.graph.key[:12]} (updated at test time): "
                   f"now an input of every program, never baked, folded or quantized")
    events.STATS.cache_misses += 1
    if differentiated:
        events.STATS.quantized[_FLOAT_UNDER_AUTOGRAD] += 1
    candidates[:] = [p for p in candidates if not p.stale()]
    if background and delegates != (eager,) and not calibration.active():
        if key not in _building:
            job = _submit(build_program, build_graph(node, sig), delegates, list(inputs), quantize,
                          calibration_sets=calibration.sets((node, sig)))
            _building[key] = (job, list(inputs), [_state(t) for t in inputs])
        events.STATS.compiling_runs += 1
        return Found(program_for(node, sig, (eager,), inputs, 1, quantize).program, False, True)
    p = build_program(build_graph(node, sig), delegates, inputs, quantize, calibration_sets=calibration.sets((node, sig)))
    candidates.append(p)
    events.STATS.graphs_built += 1
    return Found(p, False, False)


def _state(x) -> tuple | None:
    return baked_state(x) if isinstance(x, torch.Tensor) else None


def _adopt(key: tuple, candidates: list[Program]) -> None:
    """Take the background build of `key` into the cache once it is done, unless a weight it baked
    was written while it compiled (an optimizer step): its artifact may hold the old value, or
    half of each, so it is dropped and the weight pinned (the next build takes it as an input)."""
    job, submitted, states = _building[key]
    if not job.done():
        return
    del _building[key]
    p = job.result()  # a build that raised raises here, in the call, as it would have in the call
    # indices past the submitted inputs are constants the passes computed, which no one writes
    written = [submitted[i] for i, _, state in p.baked if i < len(submitted) and state != states[i]]
    for t in written:
        pin(t, "written while the program that baked it compiled in the background (updated at test "
               "time): now an input of every program, never baked, folded or quantized")
    if not written:
        candidates.append(p)
        events.STATS.graphs_built += 1


def wait_for_compiles() -> None:
    """Block until every background compile has finished (its program is taken at the next call)."""
    for job, _, _ in list(_building.values()):
        job.exception()


def programs() -> list[Program]:
    """Every program in the cache (the inspector's numeric check watches them)."""
    return [p for candidates in _programs.values() for p in candidates]


def clear_caches() -> None:
    """Forget every compiled program, recorded trie path and inferred shape (a cold start)."""
    _programs.clear()
    _runs.clear()
    _building.clear()
    calibration.forget()
    forget_recordings()

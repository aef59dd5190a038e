"""Compiled programs in memory, by graph key and guards (baked params' identity and version): the
program for a recorded graph, built on a miss once the graph has run `compile_after` times, and a
weight written between two runs pinned from then on."""
from __future__ import annotations

import warnings

import torch

from torchnative import events
from torchnative.recording import reset as forget_recordings
from torchnative.recording.trie import TrieNode, Signature, build_graph
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Delegate
from torchnative.passes.pin import pin
from torchnative.runtime import calibration
from torchnative.runtime.pipeline import build_program
from torchnative.runtime.program import Program

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


def program_for(node: TrieNode, sig: Signature, delegates: tuple[Delegate, ...],
                inputs: list[torch.Tensor], compile_after: int, quantize: str | None = None) -> tuple[Program, bool]:
    """The compiled program for this graph key and these guards (baked params' identity and
    version), building it on a miss. Until the graph has run `compile_after` times it runs on
    eager alone: compiling for a delegate costs seconds, and a graph seen once (a new shape at
    every decode step) would never repay it."""
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
    for p in candidates:
        if p.valid_for(inputs):
            events.STATS.cache_hits += 1
            return p, True
    for p in candidates:  # a weight written between two runs of this graph is updated at test time
        for t in p.changed(inputs):
            pin(t, f"written between two runs of graph {p.graph.key[:12]} (updated at test time): "
                   f"now an input of every program, never baked, folded or quantized")
    events.STATS.cache_misses += 1
    if differentiated:
        events.STATS.quantized[_FLOAT_UNDER_AUTOGRAD] += 1
    candidates[:] = [p for p in candidates if not p.stale()]
    p = build_program(build_graph(node, sig), delegates, inputs, quantize, calibration_sets=calibration.sets((node, sig)))
    candidates.append(p)
    events.STATS.graphs_built += 1
    return p, False


def programs() -> list[Program]:
    """Every program in the cache (the inspector's numeric check watches them)."""
    return [p for candidates in _programs.values() for p in candidates]


def clear_caches() -> None:
    """Forget every compiled program, recorded trie path and inferred shape (a cold start)."""
    _programs.clear()
    _runs.clear()
    calibration.forget()
    forget_recordings()

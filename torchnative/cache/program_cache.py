"""Compiled programs in memory, by graph key and guards (baked params' identity and version): the
program for a recorded graph, built on a miss once the graph has run `compile_after` times (in a
background thread, the graph running on eager until it is ready, or in the call), and a weight
written between two runs pinned from then on."""
from __future__ import annotations

import os
import sys
import threading
import warnings
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from typing import NamedTuple

import torch

from torchnative import events
from torchnative.recording import reset as forget_recordings
from torchnative.recording.trie import INPUT, TrieNode, Signature, build_graph
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Delegate
from torchnative.ir import CapturedGraph
from torchnative.passes.pin import pin
from torchnative.cache import calibration
from torchnative.build.pipeline import build_program
from torchnative.build.program import Program, baked_state
from torchnative.cache.templates import Template, confirm, forget as forget_templates, skeleton, template_for

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
_first: dict = {}  # (graph key, delegates) -> its inputs' states at its first run, until it compiles

# A graph whose input sizes change at every call (a decode step over transformers' DynamicCache:
# the keys grow by one) is a new graph each time, and none repeats enough to repay its compile
# (GPT-2's second generate() compiled 32 graphs in 158 s, eager ran it in 1.9 s). Once the same op
# sequence has been recorded with more input sizes than this, a size not compiled yet runs on
# eager, and says why. Graphs of one op sequence at one size (a model's repeated layers) count once.
SIZE_LIMIT = 8
_sizes: dict = {}  # op sequence (with inputs' ranks and dtypes) -> the input sizes recorded with it
_counted: set = set()  # graphs (trie nodes) whose sizes _sizes holds

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
    not_compiled: str = ""  # why the graph runs on eager though delegates were asked for


def _sized(node: TrieNode) -> bool:
    """Record node's graph under its op sequence; is that sequence over SIZE_LIMIT sizes?"""
    seq = skeleton(node)
    seen = _sizes.setdefault(seq, set())
    if node not in _counted:
        _counted.add(node)
        seen.add(tuple(m and m[0] for m in (n.out_metas[0] for n in node.path() if n.op == INPUT)))
        if len(seen) == SIZE_LIMIT + 1:
            warnings.warn(f"torchnative: a graph's sizes change between calls ({SIZE_LIMIT + 1} input sizes of one "
                          f"op sequence of {len(seq[0])} ops): sizes not compiled yet run on eager; "
                          "torchnative.explain() shows which", stacklevel=2)
    return len(seen) > SIZE_LIMIT


_VARYING = (f"sizes vary: this graph's op sequence was recorded with more than {SIZE_LIMIT} input sizes (its "
            f"sizes change between calls, e.g. a KV cache that grows) in a way no rule of its inputs' sizes "
            f"describes (torchnative.sizes), and a size compiled once would not repay its compile; it runs on eager")


def program_for(node: TrieNode, sig: Signature, delegates: tuple[Delegate, ...], inputs: list[torch.Tensor],
                compile_after: int, quantize: str | None = None, background: bool = False) -> Found:
    """The compiled program for this graph key and these guards (baked params' identity and
    version), building it on a miss. Until the graph has run `compile_after` times it runs on
    eager alone: compiling for a delegate costs seconds, and a graph seen once (a new shape at
    every decode step) would never repay it. With `background`, a miss starts the build on the
    background thread and the graph runs on eager's program until the build is done. A graph
    whose op sequence was recorded at other sizes runs the program of the template it matches
    (cache/templates.py): a confirmed one's at once (sizes that changed twice change again), a
    candidate's (a fit of two sizes) when the graph would compile, in place of its own."""
    recorded = node  # a miss builds its graph, or the template it matches at its sizes
    if calibration.active():  # the graph runs on eager, its inputs kept for the program built later
        calibration.keep((node, sig), inputs)
        delegates = (eager,)
    elif delegates != (eager,):
        template = template_for(node, sig)
        if template is not None and template.confirmed:
            node, compile_after = template, 1
        elif _sized(node) and not _compiled(node, sig, delegates, quantize, inputs):
            events.STATS.not_compiled["sizes vary"] += 1
            return program_for(recorded, sig, (eager,), inputs, 1, quantize)._replace(not_compiled=_VARYING)
        if compile_after > 1:
            seen = _runs[node, sig, delegates] = _runs.get((node, sig, delegates), 0) + 1
            if seen == 1:
                _first[node, sig, delegates] = [(_ref(t), _state(t)) for t in inputs]
            if seen < compile_after:
                delegates = (eager,)
            else:
                _pin_written_since_first_run(node, sig, delegates, inputs)
                if template is not None:  # one compile serves both sizes the candidate was fitted to
                    confirm(template)
                    node = template
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
            job = _submit(build_program, _graph(node, recorded, sig), delegates, list(inputs), quantize,
                          calibration_sets=calibration.sets((node, sig)))
            _building[key] = (job, list(inputs), [_state(t) for t in inputs])
        events.STATS.compiling_runs += 1
        return Found(program_for(recorded, sig, (eager,), inputs, 1, quantize).program, False, True)
    p = build_program(_graph(node, recorded, sig), delegates, inputs, quantize,
                      calibration_sets=calibration.sets((node, sig)))
    _took(node, p)
    candidates.append(p)
    events.STATS.graphs_built += 1
    return Found(p, False, False)


def _graph(built_for: TrieNode | Template, recorded: TrieNode, sig: Signature) -> CapturedGraph:
    """The graph recorded up to `recorded`, annotated with the rules of the template it runs
    under, if any (cache/templates.py)."""
    return built_for.at(recorded, sig) if isinstance(built_for, Template) else build_graph(recorded, sig)


def _pin_written_since_first_run(node: TrieNode, sig: Signature, delegates: tuple, inputs: list) -> None:
    """A weight written between the eager runs before a graph compiles (a TENT step between two
    forwards) would be baked into a program only to be found changed at the next run: it is
    pinned before the first build."""
    first = _first.pop((node, sig, delegates), None)
    if first is None:
        return
    roles = [n.role for n in node.path() if n.op == INPUT]
    for t, role, (ref, state) in zip(inputs, roles, first):
        if role == "param" and ref is not None and ref() is t and _state(t) != state:
            pin(t, "written between two runs of a graph before it compiled (updated at test time): now an "
                   "input of every program, never baked, folded or quantized")


def _compiled(node: TrieNode, sig: Signature, delegates: tuple, quantize: str | None, inputs: list) -> bool:
    key = (node, sig, delegates, quantize)
    return key in _building or any(p.valid_for(inputs) for p in _programs.get(key, ()))


def _ref(x) -> weakref.ref | None:
    return weakref.ref(x) if isinstance(x, torch.Tensor) else None


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
        _took(key[0], p)
        candidates.append(p)
        events.STATS.graphs_built += 1


def _took(built_for: TrieNode | Template, p: Program) -> None:
    """A template takes no size beyond the ranges its program's delegates took."""
    if isinstance(built_for, Template):
        built_for.narrow(p.ranges)


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
    _first.clear()
    _sizes.clear()
    _counted.clear()
    forget_templates()
    _building.clear()
    calibration.forget()
    forget_recordings()

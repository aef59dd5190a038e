"""The `ProgramCache`: compiled programs in memory, by graph key and guards (baked params'
identity and version), and every table that decides when a graph's program is built — runs so far,
sizes seen per op sequence, templates, calibration sets, background builds. The program for a
recorded graph is built on a miss once the graph has run `compile_after` times (in a background
thread, the graph running on eager until it is ready, or in the call), and a weight written
between two runs pinned from then on. Every table is bounded (torchnative.lru): a process that
runs many sizes for hours levels off, and what was dropped is compiled again if it comes back."""
from __future__ import annotations

import math
import os
import sys
import threading
import time
import warnings
import weakref
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from typing import Callable, Iterator, NamedTuple

import torch

from torchnative import events, threads
from torchnative.recording import reset as forget_recordings
from torchnative.recording.trie import Recorded
from torchnative.sizes import Sizes
from torchnative.build import apart
from torchnative.delegates.base import fresh_dispatch_state
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Delegate
from torchnative.ir import CapturedGraph, is_weight
from torchnative.passes.pin import pin
from torchnative.cache import calibration
from torchnative.lru import Lru
from torchnative.build.pipeline import build_program
from torchnative.build.program import Program, baked_state
from torchnative.build.verify import EagerFails
from torchnative.cache.templates import Template, Templates, annotated, confirm

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
# `compile_after=None` (the default: "auto"): at least COMPILE_AFTER runs (a template: one), and
# the cost rule — a graph compiles once its runs on eager took REPAY of the seconds its compile is
# estimated to take. A small graph (a tiny model's, a test suite's: ~1 ms a run) would need
# dozens of runs to repay a compile of seconds, and its calls replay on eager's program anyway; a
# GPT-2 small decode step (20 ms) compiles after ~40. The count starts again for each program (a
# new model of the same graphs: its weights are baked into a program of its own).
# TORCHNATIVE_COMPILE_AFTER=N sets a count instead (the tests' 2: a test knows which program ran).
_AUTO = os.environ.get("TORCHNATIVE_COMPILE_AFTER", "auto")
DEFAULT_COMPILE_AFTER: int | None = None if _AUTO == "auto" else int(_AUTO)
REPAY = 0.2
# a compile's seconds, estimated before this process has measured one for the delegates: what
# ONNX Runtime took here (export and session creation), per op, and a floor
_SECONDS_PER_OP, _COMPILE_FLOOR = 4e-3, 0.2

# A graph whose input sizes change at every call (a decode step over transformers' DynamicCache:
# the keys grow by one) is a new graph each time, and none repeats enough to repay its compile
# (GPT-2's second generate() compiled 32 graphs in 158 s, eager ran it in 1.9 s). Once the same op
# sequence has been recorded with more input sizes than this, a size not compiled yet runs on
# eager, and says why. Graphs of one op sequence at one size (a model's repeated layers) count once.
SIZE_LIMIT = 8
# graph keys whose programs are kept (the other tables scale with it): a GPT-2 generate() with the
# default cache needs 2 (templates), a ResNet TTA step a few, a model called at every size that
# no rule describes one per size
LIMIT = 256

# compiles off the critical path (the default; TORCHNATIVE_BACKGROUND_COMPILE=0 compiles in the
# call): one at a time (two cores: a second compile would take the call's), on a thread of their
# own, whose dispatch state is fresh as tracing compilers need; the graph runs on eager's program
# meanwhile. torch.export keeps some state per process (its pre-dispatch modes: shim.door's
# no_dispatch_modes keeps the door off it).
BACKGROUND = os.environ.get("TORCHNATIVE_BACKGROUND_COMPILE", "1") == "1"


def _background_thread() -> None:
    fresh_dispatch_state()
    apart.mark()  # its delegate compiles run in a child process (build/apart.py says why)
    sys.settrace(_in_slices)


# The compile thread's own Python (AOTAutograd tracing a differentiable graph, fx passes, loading
# an artifact) takes the GIL that each op of the caller's thread gives up around its kernel and
# needs back: with the switch interval short, an RT-DETR ActMAD step of 60 ms took 0.4-1.3 s while
# its backward was traced. While the caller's thread has made a call within _ACTIVE_S, that Python
# runs in slices of _SLICE_S, each followed by a rest of _REST_S without the GIL: the caller's
# calls keep most of their speed and the compile takes ~5x longer. An idle caller's compile runs
# at full speed. The slices are cut at Python calls (a trace function, which the interpreter calls
# at each call only: a profile function, called at each return and each call of a builtin too,
# made the compile's Python ~3x slower, the trace function ~1.8x).
_SLICE_S, _REST_S, _ACTIVE_S = 2e-3, 8e-3, 0.5
# a background build starts once the caller has made no call for _IDLE_S, or _START_WAIT_S after
# it was asked for (a caller that never pauses)
_IDLE_S, _START_WAIT_S = 0.1, 0.5


def _in_slices(frame, event: str, arg) -> None:
    """The compile thread's trace function (called at each Python call; None: no line events)."""
    now = time.perf_counter()
    if now - _switch.slice_started > _SLICE_S:
        if now - _switch.last_call < _ACTIVE_S:
            time.sleep(_REST_S)
        _switch.slice_started = time.perf_counter()


_background = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchnative-compile-background",
                                 initializer=_background_thread)
# at exit, compiles not started are dropped (the one running finishes: a thread cannot be stopped).
# threading's exit hooks run in reverse order, so this one runs before the executor's own joins.
threading._register_atexit(lambda: _background.shutdown(wait=False, cancel_futures=True))
# A call's ops release the GIL in each kernel; the compile thread takes it and keeps it until the
# switch interval runs out (5 ms): every op of the call waited that long (a ResNet-50 TENT step of
# 1.6 s took 17 s while ONNX export ran). A short interval while a compile runs bounds the wait.
_SWITCH_WHILE_COMPILING = 1e-4


def _nested_fx_trace_errors(on: bool) -> bool:
    """Dynamo's error for a compiled function called while fx traces, on or off for the calling
    thread (Dynamo's config is per thread); was it on? The compile thread's tracing (make_fx,
    torch.export, AOTAutograd) sets fx's tracing flag for the whole process, so a user's
    torch.compile'd function called meanwhile raised "Detected that you are using FX to
    symbolically trace a dynamo-optimized function"; off, that call runs the function uncompiled.
    Untouched if Dynamo was never imported."""
    dynamo = sys.modules.get("torch._dynamo")
    if dynamo is None:
        return False
    was = dynamo.config.error_on_nested_fx_trace
    dynamo.config.error_on_nested_fx_trace = on
    return was


class _Switch:
    """What changes for the rest of the process while any background compile is unfinished: the
    interpreter's switch interval (short), the asking thread's torch threads (one: threads.
    yield_to_compile) and Dynamo's nested-fx-trace error (off for that thread); the last two
    come back at that thread's next call (`settle`)."""

    def __init__(self) -> None:
        self.normal, self.unfinished, self.lock = sys.getswitchinterval(), 0, threading.Lock()
        self.finished = 0  # background builds done in this process (replay/worth.py looks for a new one)
        self.unchecked: set[int] = set()  # threads whose nested-fx-trace error is off (_nested_fx_trace_errors)
        self.last_call = self.slice_started = 0.0  # perf_counter() at a caller's last call, at the slice's start
        self.last_end = 0.0  # perf_counter() at the end of a caller's last call
        self.in_calls = 0    # calls under way (accelerated forwards)
        self.running = 0     # background builds started, not finished
        self.waiting: deque[float] = deque()  # when each build not started yet was asked for, oldest first

    def submit(self, *args, **kwargs) -> Future:
        with self.lock:
            self.unfinished += 1
            self.waiting.append(time.perf_counter())
            if threading.get_ident() not in self.unchecked and _nested_fx_trace_errors(False):
                self.unchecked.add(threading.get_ident())
        fn, *rest = args
        job = _background.submit(self._when_idle(threads.on_one_thread(fn, threads.for_programs()), self.waiting[-1]),
                                 *rest, **kwargs)
        job.add_done_callback(self._finished)
        return job

    def _when_idle(self, fn: Callable, submitted: float) -> Callable:
        """`fn`, started once the caller is idle (`idle`) or _START_WAIT_S after it was asked for
        (a caller that never pauses): a compile asked for in a call's middle took the caller's
        second torch thread for the rest of the call (GPT-2 small's first generate(): its last
        steps 40-84 ms instead of 26)."""
        def run(*args, **kwargs):
            while not self.idle() and time.perf_counter() - submitted < _START_WAIT_S:
                time.sleep(_IDLE_S / 10)
            with self.lock:
                self.waiting.popleft()
                self.running += 1
                sys.setswitchinterval(_SWITCH_WHILE_COMPILING)
            try:
                return fn(*args, **kwargs)
            finally:
                with self.lock:
                    self.running -= 1
        return run

    def idle(self) -> bool:
        """No call under way, and none for _IDLE_S: between two generate() calls, not between a
        decode step and the next, nor (mostly) between a training step's forward and the next."""
        return not self.in_calls and time.perf_counter() - self.last_end >= _IDLE_S

    def overdue(self) -> bool:
        """A build has waited for the caller to be idle for _START_WAIT_S."""
        return bool(self.waiting) and time.perf_counter() - self.waiting[0] >= _START_WAIT_S

    def settle(self) -> None:
        """A call starts: while a compile runs, the calling thread's torch threads down to one
        (threads.yield_to_compile); once no compile is left, they and Dynamo's check come back."""
        if self.running:
            threads.yield_to_compile()
        elif not self.unfinished:
            threads.reclaim()
            if self.unchecked and threading.get_ident() in self.unchecked:
                self.unchecked.discard(threading.get_ident())
                _nested_fx_trace_errors(True)

    def _finished(self, _: Future) -> None:
        with self.lock:
            self.unfinished -= 1
            self.finished += 1
            if not self.unfinished:
                sys.setswitchinterval(self.normal)


_switch = _Switch()


def settle_threads() -> None:
    """Called at each accelerated call (and capture): the calling thread's torch threads as they
    were before background compiles, once none runs; a compile's Python meanwhile in slices."""
    _switch.last_call = time.perf_counter()
    _switch.settle()


@contextmanager
def in_call() -> Iterator[None]:
    """An accelerated call under way: background builds wait for the caller to be idle (_Switch._when_idle)."""
    settle_threads()
    _switch.in_calls += 1
    try:
        yield
    finally:
        _switch.in_calls -= 1
        _switch.last_end = time.perf_counter()


def compiles_finished() -> int:
    """How many background builds have finished in this process."""
    return _switch.finished


def background(enabled: bool | None = None) -> Callable[..., Future] | None:
    """What submits a build off the call: None when compiles run in the call (`enabled` False,
    or None and the process's default, BACKGROUND, is off)."""
    return _switch.submit if (BACKGROUND if enabled is None else enabled) else None


# delegates whose `prepare` was given the compile thread, and those waiting for it (in one job)
_prepared: set[str] = set()
_to_prepare: list[Callable[[], None]] = []
_prepare_lock = threading.Lock()


def prepare(names: tuple[str, ...] | None, enabled: bool | None) -> None:
    """What the delegates' compiles need once per process (their `prepare`: ONNX's exporter imports
    and registry, ~0.7 s) done on the compile thread while the caller makes no calls, when builds
    run in the background (`enabled`, None: the process's default). Left to the first build, it ran
    in that build's slices (~5 s of a fast-weight scan's 10 s first build); run beside a call, it
    took the call's second core and the GIL (GPT-2's first generate() 3.2 s instead of 2.1). It
    waits for a pause after a call (the first call comes right after `accelerate`); with other work
    given the compile thread behind it (a build, which needs it anyway; `wait_for_compiles`), for
    the caller to be idle or that build to be overdue (_Switch.idle, overdue)."""
    from torchnative.delegates import DEFAULT, REGISTRY

    if not (BACKGROUND if enabled is None else enabled):
        return
    with _prepare_lock:
        idle = not _to_prepare
        for name in names if names is not None else DEFAULT:
            work = getattr(REGISTRY.get(name), "prepare", None)
            if work is not None and name not in _prepared:
                _prepared.add(name)
                _to_prepare.append(work)
        if idle and _to_prepare:
            _background.submit(_prepare_when_idle)


def _prepare_when_idle() -> None:
    # (the executor's queue: CPython's ThreadPoolExecutor keeps what waits for the thread there).
    # With nothing else queued: once a call has been made and the caller paused; with a build (or
    # wait_for_compiles) queued behind: once idle, or once that build is overdue
    while True:
        if _background._work_queue.empty():
            if _switch.last_end and _switch.idle():
                break
        elif _switch.idle() or _switch.overdue():
            break
        time.sleep(_IDLE_S / 10)
    with _prepare_lock:
        works, _to_prepare[:] = list(_to_prepare), []
    for work in works:
        work()


class Found(NamedTuple):
    program: Program
    hit: bool        # from the cache, not built for this call
    # eager's program, run while the delegates' one compiles in the background: that program's
    # key (`built` once done; `superseded` by its first three)
    stand_in: tuple | None
    not_compiled: str = ""  # why the graph runs on eager though delegates were asked for
    timed: tuple | None = None  # eager runs that count towards the cost rule: the run's seconds go to `ran`


_VARYING = (f"sizes vary: this graph's op sequence was recorded with more than {SIZE_LIMIT} input sizes (its "
            f"sizes change between calls, e.g. a KV cache that grows) in a way no rule of its inputs' sizes "
            f"describes (torchnative.sizes), and a size compiled once would not repay its compile; it runs on eager")


class ProgramCache:
    """Programs by (graph, signature, delegates, quantization), and what decides when one is built.
    One per process (`CACHE`); `program_for` is its one way in: calibrate → decide → look up →
    build."""

    def __init__(self, limit: int = LIMIT):
        self.programs = Lru(limit, "programs")
        self.runs = Lru(4 * limit, "run counts")   # (graph, sig, delegates) -> runs so far, for compile_after
        self.first = Lru(4 * limit, "first runs")  # (graph, sig, delegates) -> its inputs' states at its first run
        self.sizes = Lru(limit, "sizes")           # op sequence -> the input sizes recorded with it
        self.counted = Lru(4 * limit, "sized graphs")  # graphs whose sizes `sizes` holds
        self.templates = Templates(limit)
        self.calibration = Lru(limit, "calibration sets")  # graph -> the input sets kept while calibrating
        self.building: dict = {}  # program key -> (Future of the Program, inputs and their states when submitted)
        # run key -> (seconds its eager runs took, seconds at which its compile repays): the cost rule
        self.eager_seconds = Lru(4 * limit, "eager seconds")
        self.seconds_per_op: dict[tuple, float] = {}  # delegates -> compile seconds per op measured here
        # run keys (the cost rule's) whose delegates' program is built: a replay of its eager
        # program records instead, and so takes the built one (replay/trace.py)
        self.compiled_runs = Lru(4 * limit, "compiled runs")
        self.lock = threading.RLock()  # calls on several threads share the tables

    def tables(self) -> list[Lru]:
        return [self.programs, self.runs, self.first, self.sizes, self.counted, self.calibration,
                self.eager_seconds, self.compiled_runs, *self.templates.tables()]

    def resize(self, limit: int) -> None:
        """Keep at most `limit` graphs' programs (the other tables scale with it)."""
        for table in self.tables():
            table.resize(limit * (4 if table.limit > self.programs.limit else 1))

    def clear(self) -> None:
        for table in self.tables():
            table.clear()
        self.building.clear()
        self.seconds_per_op.clear()

    def program_for(self, graph: Recorded, delegates: tuple[Delegate, ...], inputs: list[torch.Tensor],
                    compile_after: int | None, quantize: str | None = None, background: bool = False) -> Found:
        """The compiled program for this graph key and these guards (baked params' identity and
        version), building it on a miss. Until the graph has run `compile_after` times (None: as
        the cost rule decides, see REPAY) it runs on eager alone: compiling for a delegate costs
        seconds, and a graph seen once (a new shape at every decode step) would never repay it. With `background`, a miss starts the build on the
        background thread and the graph runs on eager's program until the build is done. A graph
        whose op sequence was recorded at other sizes runs the program of the template it matches
        (cache/templates.py): a confirmed one's at once (sizes that changed twice change again), a
        candidate's (a fit of two sizes) when the graph would compile, in place of its own."""
        with self.lock:
            if calibration.active():  # the graph runs on eager, its inputs kept for the program built later
                self._keep_calibration_set(graph, inputs)
                delegates = (eager,)
            if delegates == (eager,):
                return self._on_eager(graph, inputs, quantize)
            built_for, delegates, why, timed = self._decide(graph, delegates, inputs, compile_after, quantize)
            if why or timed or delegates == (eager,):
                return self._on_eager(graph, inputs, quantize)._replace(not_compiled=why, timed=timed)
            return self._compiled_for(graph, built_for, delegates, inputs, quantize, background)

    def _on_eager(self, graph: Recorded, inputs: list, quantize: str | None) -> Found:
        """Eager's program for the graph: the one of the template it matches, once confirmed (one
        program for every size, its integers computed from its inputs' sizes), else its own."""
        template = self.templates.template_for(graph)
        built_for = template if template is not None and template.confirmed else graph
        return self._compiled_for(graph, built_for, (eager,), inputs, quantize, False)

    def _compiled_for(self, graph: Recorded, built_for: Recorded | Template, delegates: tuple, inputs: list,
                      quantize: str | None, background: bool) -> Found:
        """The program of `built_for` for the delegates, found or built (in the background: eager's
        meanwhile)."""
        differentiated = quantize is not None and _under_autograd(inputs)
        if differentiated:
            quantize = None
        key = (built_for, graph.sig, delegates, quantize)
        found = self._lookup(key, inputs)
        if found is not None:
            events.STATS.cache_hits += 1
            return Found(found, True, None)
        events.STATS.cache_misses += 1
        if differentiated:
            events.STATS.quantized[_FLOAT_UNDER_AUTOGRAD] += 1
        if background and delegates != (eager,) and not calibration.active():
            self._build_in_background(key, graph, inputs)
            events.STATS.compiling_runs += 1
            return Found(self._on_eager(graph, inputs, quantize).program, False, key)
        try:
            p = build_program(_graph(graph, _rules(built_for)), delegates, inputs, quantize,
                              calibration_sets=self.calibration.get(graph, []))
        except EagerFails:  # this call's inputs are at fault: eager's program raises its error, naming the op
            return self._on_eager(graph, inputs, quantize)
        self._took(key, p)
        return Found(p, False, None)

    def _decide(self, graph: Recorded, delegates: tuple, inputs: list, compile_after: int | None,
                quantize: str | None) -> tuple[Recorded | Template, tuple, str, tuple | None]:
        """What to build for this graph — its own graph or its template — and for which delegates
        yet (eager alone until it has run `compile_after` times, or until the cost rule says its
        compile repays), or why it stays on eager; and the run key whose eager time this run adds
        to (the cost rule's)."""
        template = self.templates.template_for(graph)
        if not any(getattr(d, "dynamic", False) for d in delegates if d is not eager):
            # delegates of static shapes only would decline every node of a graph for every size:
            # each size is a graph of its own for them (up to SIZE_LIMIT sizes), as bundles pad to buckets
            template = None
        built_for, auto = graph, compile_after is None
        if template is not None and template.confirmed:
            built_for, compile_after = template, 1
        elif self._sized(graph) and not self._compiled((graph, graph.sig, delegates, quantize), inputs):
            events.STATS.not_compiled["sizes vary"] += 1
            return graph, (eager,), _VARYING, None
        needed = COMPILE_AFTER if compile_after is None else compile_after
        if needed > 1 or auto:
            # graphs at sizes a template (a candidate too) stands for count as one: calls at a new
            # size each time (BERT at every length) add their runs up to the template's compile
            run_key = (template or built_for, graph.sig, delegates)
            seen = self.runs[run_key] = self.runs.get(run_key, 0) + 1
            if seen == 1:
                self.first[run_key] = [(_ref(t), _state(t)) for t in inputs]
                if auto:  # its first run's seconds are not counted (None): mostly one-time work, kernels' first calls
                    self.eager_seconds[run_key] = (None, REPAY * self._estimate(delegates, graph.n_ops))
            if seen < needed:
                return built_for, (eager,), "", run_key if auto else None
            if auto and not self._compiled((built_for, graph.sig, delegates, quantize), inputs):
                spent = self.eager_seconds.get(run_key, (0.0, 0.0))[0] or 0.0
                estimate = self._estimate(delegates, graph.n_ops)
                self.eager_seconds[run_key] = (spent, REPAY * estimate)
                if spent < REPAY * estimate:
                    events.STATS.not_compiled["cost"] += 1
                    return built_for, (eager,), _cost(spent, estimate), run_key
            self._pin_written_since_first_run(graph, run_key, inputs)
            if template is not None:  # one compile serves both sizes the candidate was fitted to
                confirm(template)
                built_for = template
        return built_for, delegates, "", None

    def ran(self, run_key: tuple, seconds: float) -> bool:
        """A graph's run on eager took `seconds` (the cost rule adds them up); has its compile
        repaid now (a replay of it should record again, to compile)?"""
        found = self.eager_seconds.get(run_key)
        if found is None:  # not weighed yet (or forgotten): counted once it is
            self.eager_seconds[run_key] = (0.0, math.inf)
            return False
        spent, repays = found
        if spent is None:  # the first run: not counted
            self.eager_seconds[run_key] = (0.0, repays)
            return False
        self.eager_seconds[run_key] = (spent + seconds, repays)
        return spent < repays <= spent + seconds

    def _estimate(self, delegates: tuple, n_ops: int) -> float:
        """Seconds a compile of a graph of `n_ops` ops for `delegates` is expected to take."""
        per_op = self.seconds_per_op.get(tuple(d.name for d in delegates), _SECONDS_PER_OP)
        return _COMPILE_FLOOR + per_op * n_ops

    def _lookup(self, key: tuple, inputs: list) -> Program | None:
        """A cached program valid for these inputs; a weight baked into one that was written since
        is pinned (its next build takes it as an input), and programs that can never run again
        are dropped."""
        candidates = self.programs.setdefault(key, [])
        if key in self.building:
            self._adopt(key, candidates)
        for p in candidates:
            if p.valid_for(inputs):
                return p
        for p in candidates:  # a weight written between two runs of this graph is updated at test time
            for t in p.changed(inputs):
                pin(t, f"written between two runs of graph {p.graph.key[:12]} (updated at test time): "
                       f"now an input of every program, never baked, folded or quantized")
        candidates[:] = [p for p in candidates if not p.stale()]
        return None

    def _build_in_background(self, key: tuple, graph: Recorded, inputs: list) -> None:
        if key not in self.building:
            built_for, _, delegates, quantize = key
            # the build runs its program and eager's on these values after this call and later ones
            # wrote its states (a cache's counter moved past the last slot): they are taken as they
            # are now; the weights, which it bakes by identity, are not copied
            now = [_as_now(t) if isinstance(t, torch.Tensor) and not is_weight(role) else t
                   for t, role in zip(inputs, graph.placeholder_roles())]
            # the graph itself is built on the compile thread too (its fx nodes, a template's rules
            # marked on them: ~10 ms for a GPT-2 template), from the template's rules as they are now
            sizes = _rules(built_for)
            # and the memory of each tensor it reads as it is held until it ends: a caller that
            # gives a weight other memory meanwhile (`t_p.data = ...`, a mean teacher's EMA step)
            # freed what the build was reading (a segfault in its check against eager)
            held = [t.untyped_storage() for t, given in zip(now, inputs) if t is given and isinstance(t, torch.Tensor)
                    and t.layout == torch.strided and not t.is_quantized]
            job = _switch.submit(_built, graph, sizes, delegates, now, quantize, self.calibration.get(graph, []), held)
            self.building[key] = (job, list(inputs), [_state(t) for t in inputs])
            job.add_done_callback(lambda _, run_key=key[:3]: self._compiled_run(run_key))

    def _adopt(self, key: tuple, candidates: list[Program]) -> None:
        """Take the background build of `key` into the cache once it is done, unless a weight it baked
        was written while it compiled (an optimizer step): its artifact may hold the old value, or
        half of each, so it is dropped and the weight pinned (the next build takes it as an input)."""
        job, submitted, states = self.building[key]
        if not job.done():
            return
        del self.building[key]
        try:
            p = job.result()  # a build that raised raises here, in the call, as it would have in the call
        except EagerFails:  # the call it was given the inputs of raised eager's error; a later call builds
            return
        # indices past the submitted inputs are constants the passes computed, which no one writes
        written = [submitted[i] for i, _, state in p.baked if i < len(submitted) and state != states[i]]
        for t in written:
            pin(t, "written while the program that baked it compiled in the background (updated at test "
                   "time): now an input of every program, never baked, folded or quantized")
        if not written:
            self._took(key, p)

    def _compiled_run(self, run_key: tuple) -> None:
        with self.lock:
            self.compiled_runs[run_key] = True

    def _retire_covered(self, key: tuple) -> None:
        """The programs of single sizes this template's program runs too, for the same delegates:
        retired and dropped. Each held its own copy of the weights in its runtime (an ONNX Runtime
        session copies the initializers it is given, prepacked or not: measured, a model's size
        per program)."""
        template, rest = key[0], key[1:]
        if rest[1] == (eager,):  # eager's programs hold no copy: replays of them go on
            return
        skeletons = {self.templates.skeleton(g) for g in template.fitted}
        covered = [k for k in self.programs if k[1:] == rest and isinstance(k[0], Recorded)
                   and self.templates.skeleton(k[0]) in skeletons and template.sizes.match(k[0].flat()) is not None]
        for k in covered:
            for p in self.programs.pop(k):
                p.retired = True
            events.STATS.evicted["programs a template's runs"] += 1

    def repaid(self, run_key: tuple) -> bool:
        """Have a graph's runs on eager repaid its compile (the call that runs it should record, to
        compile it)? Calls run as eager count too (replay/worth.py), and a replay never sees them cross."""
        found = self.eager_seconds.get(run_key)
        return found is not None and found[0] is not None and found[0] >= found[1]

    def superseded(self, run_key: tuple) -> bool:
        """Has the program its eager runs stood in for (the cost rule's `run_key`, or a background
        build's) been built?"""
        return run_key in self.compiled_runs

    def built(self, key: tuple, inputs: list) -> Program | None:
        """The program of `key` (a background build's, done) valid for these inputs: what a
        recording of the call would find (replay/trace.py's stand-ins)."""
        with self.lock:
            return self._lookup(key, inputs)

    def _took(self, key: tuple, p: Program) -> None:
        """A built program into the cache; a template takes no size beyond the ranges its
        program's delegates took; what its compile took per op, for the next estimate."""
        if isinstance(key[0], Template):
            key[0].narrow(p.ranges)
            self._retire_covered(key)
        self.programs.setdefault(key, []).append(p)
        events.STATS.graphs_built += 1
        # its weights' next program (a new model of the same graphs) repays its own compile
        self.eager_seconds.pop(key[:3], None)
        self.compiled_runs[key[:3]] = True
        ops = sum(s.n_ops() for s in p.steps)
        if ops and any(d.name != eager.name for d in key[2]):
            names = tuple(d.name for d in key[2])
            measured = sum(s.compile_s for s in p.steps) / ops
            self.seconds_per_op[names] = (self.seconds_per_op.get(names, measured) + measured) / 2

    def _sized(self, graph: Recorded) -> bool:
        """Record the graph's input sizes under its op sequence; is that sequence over SIZE_LIMIT sizes?"""
        seq = self.templates.skeleton(graph)
        seen = self.sizes.setdefault(seq, set())
        if graph not in self.counted:
            self.counted[graph] = True
            seen.add(graph.input_shapes())
            if len(seen) == SIZE_LIMIT + 1:
                warnings.warn(f"torchnative: a graph's sizes change between calls ({SIZE_LIMIT + 1} input sizes of one "
                              f"op sequence of {len(seq[0])} ops): sizes not compiled yet run on eager; "
                              "torchnative.explain() shows which", stacklevel=2)
        return len(seen) > SIZE_LIMIT

    def _compiled(self, key: tuple, inputs: list) -> bool:
        return key in self.building or any(p.valid_for(inputs) for p in self.programs.get(key, ()))

    def _pin_written_since_first_run(self, graph: Recorded, run_key: tuple, inputs: list) -> None:
        """A weight written between the eager runs before a graph compiles (a TENT step between two
        forwards) would be baked into a program only to be found changed at the next run: it is
        pinned before the first build."""
        first = self.first.pop(run_key, None)
        if first is None:
            return
        for t, role, (ref, state) in zip(inputs, graph.input_roles(), first):
            if role == "param" and ref is not None and ref() is t and _state(t) != state:
                pin(t, "written between two runs of a graph before it compiled (updated at test time): now an "
                       "input of every program, never baked, folded or quantized")

    def _keep_calibration_set(self, graph: Recorded, inputs: list) -> None:
        sets = self.calibration.setdefault(graph, [])
        if len(sets) < calibration.LIMIT:
            # parameters are the same tensors in every set: kept by reference, not copied
            sets.append([t.detach().clone() if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter)
                         else t for t in inputs])

    def all_programs(self) -> list[Program]:
        return [p for candidates in self.programs.values() for p in candidates]

    def wait(self) -> None:
        for job, _, _ in list(self.building.values()):
            job.exception()


CACHE = ProgramCache()


def _cost(spent: float, estimate: float) -> str:
    return (f"not compiled yet: its runs on eager took {spent * 1e3:.1f} ms so far, and its compile is estimated at "
            f"{estimate:.1f} s; it compiles once they reach {REPAY:.0%} of that (the cost rule; "
            f"compile_after=N compiles after N runs instead)")


def _rules(built_for: Recorded | Template) -> Sizes | None:
    """The rules of the template a program is built for, if any (cache/templates.py)."""
    return built_for.sizes if isinstance(built_for, Template) else None


def _graph(graph: Recorded, sizes: Sizes | None) -> CapturedGraph:
    """The recorded graph, annotated with a template's rules `sizes`, if any: what a program for
    the template is built from (a delegate that plans memory for the largest size builds one per
    bucket of sizes, sizes.bucket)."""
    return annotated(graph, sizes, graph.flat()) if sizes is not None else graph.graph()


def _built(graph: Recorded, sizes: Sizes | None, delegates: tuple, inputs: list, quantize: str | None,
           calibration_sets: list, held: list) -> Program:
    """The background build of a graph's program: its graph (with a template's rules as they were
    at submission), then its program. `held`: the storages of the caller's tensors among `inputs`,
    alive (as this call's arguments) until the build ends."""
    return build_program(_graph(graph, sizes), delegates, inputs, quantize, calibration_sets=calibration_sets)


def _as_now(t: torch.Tensor) -> torch.Tensor:
    """A copy of `t`'s values with its sizes, strides and offset (its storage copied; a sparse or
    quantized tensor, which has no such storage, cloned)."""
    with torch.no_grad():
        if t.layout != torch.strided or t.is_quantized:
            copy = t.detach().clone()
        else:
            copy = torch.empty(0, dtype=t.dtype, device=t.device).set_(
                t.untyped_storage().clone(), t.storage_offset(), t.size(), t.stride())
    return copy.requires_grad_(t.requires_grad) if t.is_floating_point() or t.is_complex() else copy


def _ref(x) -> weakref.ref | None:
    return weakref.ref(x) if isinstance(x, torch.Tensor) else None


def _state(x) -> tuple | None:
    return baked_state(x) if isinstance(x, torch.Tensor) else None


def program_for(graph: Recorded, delegates: tuple[Delegate, ...], inputs: list[torch.Tensor],
                compile_after: int | None, quantize: str | None = None, background: bool = False) -> Found:
    """`CACHE.program_for`: the one door into the program cache."""
    return CACHE.program_for(graph, delegates, inputs, compile_after, quantize, background)


def wait_for_compiles() -> None:
    """Block until every background compile has finished (its program is taken at the next call)."""
    CACHE.wait()
    # and the jobs given the compile thread without the cache (build/differentiable.py's): it runs
    # them in order, so a job given now finishes after them
    _background.submit(lambda: None).result()
    _switch.settle()


def programs() -> list[Program]:
    """Every program in the cache (the inspector's numeric check watches them)."""
    return CACHE.all_programs()


def clear_caches() -> None:
    """Forget every compiled program, recorded trie path and inferred shape (a cold start)."""
    CACHE.clear()
    forget_recordings()

"""A capture session: the door's handler for one thread, from `capture()` entry to exit."""
from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Any, Iterator, Sequence

from torchnative import events, threads
from torchnative.recording.recorder import Recorder
from torchnative.recording.scalars import PROCESS, FloatSites
from torchnative.recording.trie import Recorded
from torchnative.delegates import resolve
from torchnative.interface import Delegate
from torchnative.cache.program_cache import BACKGROUND, CACHE, DEFAULT_COMPILE_AFTER, program_for, settle_threads
from torchnative.replay.tracer import Tracer
from torchnative.shim import DoorMode, LazyTensor, current_handler, set_handler
from torchnative.shim.data import recorded_data


def _executor(delegates: tuple[Delegate, ...], tracer: Tracer | None, compile_after: int, quantize: str | None,
              background: bool):
    def execute(graph: Recorded, inputs: list, n_ops: int, roots: list) -> list:
        program, hit, stand_in, not_compiled, timed = program_for(graph, delegates, inputs, compile_after, quantize,
                                                                  background)
        seconds = 0.0
        if timed is None:
            values = program(inputs)
        else:  # a run on eager the cost rule counts
            started = time.perf_counter()
            values = program(inputs)
            seconds = time.perf_counter() - started
            CACHE.ran(timed, seconds)
        if tracer is not None:
            tracer.compiling = tracer.compiling or stand_in is not None
            tracer.ran(program, inputs, values, roots, graph, timed, seconds, stand_in)
        events.STATS.graph_runs += 1
        events.emit(events.GraphRun(program.graph, hit, n_ops, program.partitions, False, program, not_compiled))
        return values
    return execute


@contextmanager
def session(delegates: Sequence[str] | None = None, weights: frozenset[int] = frozenset(),
            tracer: Tracer | None = None, compile_after: int | None = DEFAULT_COMPILE_AFTER, quantize: str | None = None,
            background: bool | None = None, sites: FloatSites | None = PROCESS) -> Iterator[Recorder | None]:
    """`weights`: ids of real tensors to treat as weights (`param` role), e.g. module buffers;
    `tracer` watches the session for replay; `compile_after`, `background`: see `program_for`
    (None: `program_cache.BACKGROUND`); `quantize`: a weight quantization scheme
    (passes.quantize); `sites`: see `Recorder`. Nested, the outer session records and its
    settings hold."""
    outer = current_handler()
    if isinstance(outer, Recorder):  # nested: the outer session records; its end is a cut
        if tracer is not None:
            tracer.refuse("called inside another capture")
        yield outer
        outer.flush()
        return
    settle_threads()
    mode = DoorMode()
    background = BACKGROUND if background is None else background
    chosen = resolve(delegates)
    if len(chosen) > 1:  # a delegate besides eager: its thread pool shares the cores with torch's
        threads.check()
    recorder = Recorder(_executor(chosen, tracer, compile_after, quantize, background), mode, weights, sites)
    if tracer is not None:
        recorder.observe, recorder.check = tracer.eager, tracer.checked
    previous = set_handler(recorder)
    try:
        with mode, recorded_data():
            yield recorder
    finally:
        try:
            recorder.flush()
        finally:
            set_handler(previous)


def real_outputs(out: Any) -> Any:
    """Model outputs as plain tensors where autograd does not need the lazy wrapper."""
    if type(out) is LazyTensor:
        return out if out.requires_grad else out._value
    if isinstance(out, tuple) and not hasattr(out, "_fields"):
        return type(out)(real_outputs(o) for o in out)
    if isinstance(out, list):
        return [real_outputs(o) for o in out]
    if isinstance(out, dict):  # includes transformers' ModelOutput (an OrderedDict)
        for k, v in list(out.items()):
            out[k] = real_outputs(v)
    return out

"""torch's OpenMP threads and a delegate's own thread pool share the cores.

libgomp (torch's OpenMP on Linux) keeps its threads busy-waiting for ~300,000 spins after every
parallel region before they sleep. A delegate program that starts meanwhile (ONNX Runtime's and
XNNPACK's pools are their own) runs its threads on the cores they spin on: a GPT-2 small decode
step's ONNX Runtime program took 19.0 ms (p50) after `generate()`'s eager ops, 13.6 ms with a
short spin (`GOMP_SPINCOUNT=10000`), eager's own step time unchanged (31.6-32.7 vs 29.6-32.5 ms).
libgomp reads the setting once, when torch loads it: importing torchnative before torch sets a
short spin; after torch, `accelerate`/`capture` say once how to.
"""
from __future__ import annotations

import os
import sys
import threading
import warnings
from typing import Any, Callable

SPIN = "10000"
_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")
_warned = [False]


def before_torch() -> None:
    """A short spin for torch's OpenMP threads, if torch is not loaded yet and the user set none."""
    if "torch" not in sys.modules and not any(s in os.environ for s in _SETTINGS):
        os.environ["GOMP_SPINCOUNT"] = SPIN


def check() -> None:
    """Warn once when torch's OpenMP threads spin as long as libgomp's default."""
    if _warned[0]:
        return
    _warned[0] = True
    import torch

    if sys.platform == "linux" and torch.get_num_threads() > 1 and not any(s in os.environ for s in _SETTINGS):
        warnings.warn("torchnative: torch's OpenMP threads busy-wait after each eager op (libgomp's default spin) on "
                      "the cores delegate programs then run on, slowing them (a GPT-2 decode step's ONNX Runtime "
                      f"program 19 ms instead of 13.6); set GOMP_SPINCOUNT={SPIN} in the environment, or import "
                      "torchnative before torch", stacklevel=4)


_local = threading.local()


# thread id -> the torch thread count it had before a background compile started beside it
_yielded: dict[int, int] = {}


def for_programs() -> int:
    """Threads a delegate's runtime should use: the calling thread's torch count (as it was before
    it yielded to a compile), or, on the background compile thread (whose own torch ops run on
    one), the count of the thread that asked for the compile."""
    import torch

    return getattr(_local, "callers", None) or _yielded.get(threading.get_ident()) or torch.get_num_threads()


def yield_to_compile() -> None:
    """The calling thread's OpenMP team down to one while a background compile runs beside it. On
    two cores a team of two, one of its threads time-sliced against the compile thread, waits at
    every barrier for it: ActMAD's eager steps on RT-DETR took 0.1-1.2 s instead of 35 ms for the
    ~25 steps a compile ran; with one thread the compile was done within 3 steps."""
    import torch

    me = threading.get_ident()
    if me not in _yielded and torch.get_num_threads() > 1:
        _yielded[me] = torch.get_num_threads()
        torch.set_num_threads(1)


def reclaim() -> None:
    """The calling thread's team as it was before `yield_to_compile` (no compile runs any more),
    unless the caller set another count meanwhile."""
    n = _yielded.pop(threading.get_ident(), None)
    if n is not None:
        import torch

        if torch.get_num_threads() == 1:
            torch.set_num_threads(n)


def on_one_thread(fn: Callable[..., Any], callers: int) -> Callable[..., Any]:
    """`fn` to run on the background compile thread: one torch thread for the ops its tracing
    runs on example inputs (not an OpenMP team beside the caller's on two cores). `callers`: the
    caller's torch thread count, for the runtimes the compile loads (for_programs). (A nice-19
    compile thread made ActMAD on RT-DETR's steps 3-11 7.6-8.0 s instead of 10.8-12.3 s, but the
    runtimes' threads it starts inherit its priority, and the default suite stalled in a test
    waiting for compiles: not kept.)"""
    def run(*args: Any, **kwargs: Any) -> Any:
        import torch

        torch.set_num_threads(1)  # this thread's OpenMP team only
        _local.callers = callers
        return fn(*args, **kwargs)
    return run


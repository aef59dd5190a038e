"""The forward of an accelerated module (`torchnative.accelerate`): each call is replayed
(runtime/replayer.py) when its guards (runtime/guard.py) match a trace seen twice in a row, else
recorded in a session (runtime/session.py) that a `Tracer` watches, and the replayer learns what
the recording did."""
from __future__ import annotations

import functools
from typing import Any, Callable, Sequence

import torch

from torchnative.runtime import calibration as _calibration
from torchnative.runtime.guard import flatten_call, guard_key
from torchnative.runtime.replayer import Replayer
from torchnative.runtime.session import real_outputs, session
from torchnative.runtime.tracer import Tracer
from torchnative.shim import current_handler


def accelerated_forward(model: torch.nn.Module, original: Callable, *, delegates: Sequence[str] | None,
                        replay: bool, compile_after: int, quantize: str | None) -> Callable:
    """The forward that records (or replays) each call of `model`'s `original` forward; the
    settings are `accelerate`'s."""
    buffers = frozenset(id(b) for b in model.buffers())  # weights too, unless a graph writes them
    replayer = Replayer(buffers)

    @functools.wraps(original)
    def forward(*args: Any, **kwargs: Any) -> Any:
        key = None
        # inside a capture the outer session records; while calibrating every call is recorded
        if replay and current_handler() is None and not _calibration.active():
            leaves, spec = flatten_call(args, kwargs)
            key = guard_key(model, leaves, spec, replayer.snapshots)
        if key is None:
            with session(delegates, buffers, compile_after=compile_after, quantize=quantize):
                out = original(*args, **kwargs)
            return real_outputs(out)  # after the session: its end runs the pending graph
        replayed, out = replayer.replay(key, leaves)
        if replayed:
            return out
        tracer = Tracer()
        with session(delegates, buffers, tracer, compile_after, quantize):
            out = original(*args, **kwargs)
        out = real_outputs(out)
        if guard_key(model, leaves, spec, replayer.snapshots) != key:  # the call changed an argument object's Python state
            tracer.refuse("the call changed the Python state of an argument object")
        replayer.learn(key, tracer, leaves, out)
        return out

    return forward

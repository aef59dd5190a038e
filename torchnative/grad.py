"""Writes that autograd must not see, at the cost of the writes alone: capture writes a graph's
state updates back into the real tensors, and so does a replayed call; programs run their
partitions with grad off."""
from __future__ import annotations

import contextlib

import torch

_NOTHING = contextlib.nullcontext()


def no_grad() -> contextlib.AbstractContextManager:
    """`torch.no_grad()`, or nothing to enter when grad is off already (inference: entering it
    costs 2 us, several times that right after a delegate's run has evicted the caches)."""
    return torch.no_grad() if torch.is_grad_enabled() else _NOTHING


WRITES = "_torchnative_writes"


def copy_back(roots: list[torch.Tensor], values: list[torch.Tensor]) -> None:
    """Each root given its new value, in one call (a decode step writes a dozen counters), but
    for the roots the program wrote in place (passes.state), whose value is the root itself.
    Each root counts the writes (`writes`): the recorder sets their versions back, as eager's
    kernels leave BatchNorm's running stats at theirs, so a program that baked a root must ask
    this count to see that it changed."""
    pairs = [(r, v) for r, v in zip(roots, values) if r is not v]
    if pairs:
        with no_grad():
            torch._foreach_copy_(*map(list, zip(*pairs)))
    for r in roots:
        setattr(r, WRITES, getattr(r, WRITES, 0) + 1)


def writes(t: torch.Tensor) -> int:
    """How many times captured graphs wrote `t` as state."""
    return getattr(t, WRITES, 0)


def version(t: torch.Tensor) -> int:
    """`t._version`, or -1 for an inference tensor, which has none (made in inference mode: a
    static cache's tensors, or weights of a model built there)."""
    return -1 if t.is_inference() else t._version

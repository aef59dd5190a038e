"""Calibration sets for delegates that quantize activations (`qnn`). Inside `calibrate()` every
graph runs on eager and its inputs are kept (up to `LIMIT` sets per graph); a program built later
for the same graph calibrates on all of them, besides the inputs it is built with."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Hashable, Iterator

import torch

LIMIT = 64
_active = 0
_kept: dict[Hashable, list[list[torch.Tensor]]] = {}


@contextmanager
def calibrate() -> Iterator[None]:
    global _active
    _active += 1
    try:
        yield
    finally:
        _active -= 1


def active() -> bool:
    return _active > 0


def keep(graph: Hashable, inputs: list[torch.Tensor]) -> None:
    sets = _kept.setdefault(graph, [])
    if len(sets) < LIMIT:
        # parameters are the same tensors in every set: kept by reference, not copied
        sets.append([t.detach().clone() if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) else t
                     for t in inputs])


def sets(graph: Hashable) -> list[list[torch.Tensor]]:
    return _kept.get(graph, [])


def forget() -> None:
    _kept.clear()

"""Calibration for delegates that quantize activations (`qnn`). Inside `calibrate()` every graph
runs on eager and the program cache keeps its inputs (up to `LIMIT` sets per graph); a program
built later for the same graph calibrates on all of them, besides the inputs it is built with."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

LIMIT = 64
_active = 0


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

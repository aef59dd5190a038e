"""Delegates: one module per target, each with its `Delegate` instances (torchnative.interface)."""
from __future__ import annotations

import functools
import warnings
from typing import Sequence

from torchnative.delegates import coreai, coreml, eager, hf_candle, iree, ort, qnn, xnnpack
from torchnative.interface import Delegate

REGISTRY: dict[str, Delegate] = {d.name: d for d in (xnnpack.delegate, ort.delegate, qnn.delegate, coreml.delegate, coreai.delegate, iree.vulkan, iree.cpu,
                                                     hf_candle.delegate,
                                                     hf_candle.q8_0, hf_candle.q4k, eager.delegate)}
# The fastest correct order measured here (benchmarks/models.py): ONNX Runtime led on every
# workload; XNNPACK trailed it and takes fewer ops; candle is for quantized weights, by request.
DEFAULT: tuple[str, ...] = ("ort",)


def resolve(names: Sequence[str] | None) -> tuple[Delegate, ...]:
    """Delegates in preference order; eager is always last, for what no other takes. None means
    DEFAULT, those of it that execute here (a missing one is warned about once)."""
    return _resolve(_default() if names is None else tuple(names))


@functools.cache  # availability does not change while the process runs; a session starts per call
def _resolve(names: tuple[str, ...]) -> tuple[Delegate, ...]:
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown delegate(s) {unknown}; known: {sorted(REGISTRY)}")
    chosen = []
    for n in names:
        d = REGISTRY[n]
        status = d.available()
        # compile-only delegates are taken when named: their partitions compile (a bundle ships
        # them) and run on eager here, each fallback recorded with the reason
        if status.status == "unavailable":
            raise RuntimeError(f"delegate {n!r} is unavailable here: {status.reason}"
                               + (f" (install: {status.install_hint})" if status.install_hint else ""))
        chosen.append(d)
    if "eager" not in names:
        chosen.append(REGISTRY["eager"])
    return tuple(chosen)


@functools.cache
def _default() -> tuple[str, ...]:
    usable = []
    for n in DEFAULT:
        status = REGISTRY[n].available()
        if status.status == "executes":
            usable.append(n)
        else:
            warnings.warn(f"torchnative: default delegate {n!r} cannot execute here ({status.reason}); "
                          f"its graphs run on eager. Install: {status.install_hint}", stacklevel=4)
    return tuple(usable)


__all__ = ["REGISTRY", "DEFAULT", "resolve"]

"""Delegates: one module per target, each with one `delegate` (see base.Delegate)."""
from __future__ import annotations

from typing import Sequence

from torchnative.delegates import candle, eager, ort, xnnpack
from torchnative.delegates.base import Artifact, Availability, Delegate, Support

REGISTRY: dict[str, Delegate] = {d.name: d for d in (xnnpack.delegate, ort.delegate, candle.delegate, candle.q8_0,
                                                     candle.q4k, eager.delegate)}
DEFAULT: tuple[str, ...] = ("eager",)


def resolve(names: Sequence[str] | None) -> tuple[Delegate, ...]:
    """Delegates in preference order; eager is always last, for what no other takes."""
    names = DEFAULT if names is None else tuple(names)
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown delegate(s) {unknown}; known: {sorted(REGISTRY)}")
    chosen = []
    for n in names:
        d = REGISTRY[n]
        status = d.available()
        if status.status != "executes":
            raise RuntimeError(f"delegate {n!r} cannot execute here: {status.reason}"
                               + (f" (install: {status.install_hint})" if status.install_hint else ""))
        chosen.append(d)
    if "eager" not in names:
        chosen.append(REGISTRY["eager"])
    return tuple(chosen)


__all__ = ["Artifact", "Availability", "Delegate", "Support", "REGISTRY", "DEFAULT", "resolve"]

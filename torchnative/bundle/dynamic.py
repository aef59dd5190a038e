"""Bundles that take a range of sizes (`capture-and-compile --dynamic input_ids:1,attention_mask:1=2..512`).

The named dims share one size, `n`. The call is captured at three values of n: each of its graphs'
recordings is fitted (torchnative.sizes: the first two into rules, the third checked against
them) and compiled once, as the template that stands for every n of the range. What the manifest
says about a size that follows n is an expression in n ("n", "2*n+1"), which a loaded bundle
evaluates for the n its inputs have: inputs' shapes, partitions' outputs and their layouts,
views Python took of graph values. A call whose graphs or Python path change with n within the
three sizes, or whose model takes a narrower range than asked (a table of 512 positions), is
refused with what it does take.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any, Sequence

import torch

from torchnative.bundle.format import BundleError
from torchnative.delegates import resolve
from torchnative.build.pipeline import build_program
from torchnative.cache.templates import annotated
from torchnative.sizes import fit, narrowest

_SPEC = re.compile(r"^((?:[\w.]+:\d+,)*[\w.]+:\d+)=(\d+)\.\.(\d+)$")
_EXPR = re.compile(r"^(?:(\d+)\*)?n([+-]\d+)?$")


@dataclass(frozen=True)
class Dynamic:
    """Dims of the inputs (name, dim) that share one size n, from `low` to `high`."""
    dims: tuple[tuple[str, int], ...]
    low: int
    high: int

    def record(self, example: int) -> dict:
        return {"name": "n", "range": [self.low, self.high], "dims": [list(d) for d in self.dims], "example": example}


def parse(spec: str) -> Dynamic:
    """`input_ids:1,attention_mask:1=2..512`."""
    m = _SPEC.match(spec.replace(" ", ""))
    if m is None:
        raise BundleError(f"--dynamic {spec!r}: expected NAME:DIM[,NAME:DIM...]=LOW..HIGH, e.g. "
                          f"input_ids:1,attention_mask:1=2..512 (the dims that share one size, and its range)")
    dims = tuple((name, int(d)) for name, d in (x.split(":") for x in m.group(1).split(",")))
    low, high = int(m.group(2)), int(m.group(3))
    if low < 2 or high < low + 2:
        raise BundleError(f"--dynamic {spec!r}: the range must start at 2 or above (torch.export fixes sizes 0 "
                          f"and 1) and hold three sizes at least")
    return Dynamic(dims, low, high)


def expr(coef: int, const: int) -> int | str:
    """`coef·n + const` as the manifest writes it."""
    if coef == 0:
        return const
    return f"{'' if coef == 1 else f'{coef}*'}n{'' if const == 0 else f'{const:+d}'}"


def evaluate(x: int | str, n: int) -> int:
    if isinstance(x, int):
        return x
    m = _EXPR.match(x)
    if m is None:
        raise BundleError(f"the manifest's size {x!r} is no expression in n (k*n+c): the bundle was tampered with")
    return int(m.group(1) or 1) * n + int(m.group(2) or 0)


def resized(inputs: dict[str, Any], dynamic: Dynamic, n: int) -> dict[str, Any]:
    """The example inputs with the dynamic dims at size n, their values repeated along them."""
    out = dict(inputs)
    for name, d in dynamic.dims:
        t = inputs[name]
        out[name] = t.index_select(d, torch.arange(n) % t.shape[d])
    return out


def example_size(inputs: dict[str, Any], dynamic: Dynamic) -> int:
    sizes = {inputs[name].shape[d] for name, d in dynamic.dims if name in inputs and d < inputs[name].dim()}
    missing = [f"{name}:{d}" for name, d in dynamic.dims if name not in inputs or d >= inputs[name].dim()]
    if missing or len(sizes) != 1:
        raise BundleError(f"--dynamic names {', '.join(missing) or 'dims of different sizes'}: each must be a dim of "
                          f"an example input ({', '.join(inputs)}), all of one size")
    return sizes.pop()


def samples(example: int, dynamic: Dynamic) -> list[int]:
    """Three sizes to capture: the example's (clamped into the range) and its two neighbours."""
    n = min(max(example, dynamic.low), dynamic.high - 2)
    return [n, n + 1, n + 2]


@dataclass
class Sized:
    """A graph of the call as its template: the program compiled for every n, and each symbol
    of its rules as (coef, const) of n."""
    program: Any
    symbols: dict[int, tuple[int, int]]
    low: int
    high: int


def template(k: int, recorded: list[tuple], ns: list[int], run_inputs: list, targets: Sequence[str] | None,
             quantize: str | None, dynamic: Dynamic) -> Sized:
    """Graph k of the call, recorded at the sizes `ns`, as one program for every n of the range."""
    flats = [r.flat() for r in recorded]
    sizes = fit(flats[0], flats[1])
    values = [sizes.match(f) if sizes is not None else None for f in flats]
    if sizes is None or values[2] is None:
        raise BundleError(f"graph {k} of the call changes its structure between n = {ns[0]} and n = {ns[2]}, or has "
                          f"sizes no rule a*n + c gives: it cannot be compiled for a range of n")
    symbols, low, high = {}, [], []
    for j, (lo, hi) in enumerate(sizes.ranges):
        s = [v[j] for v in values]
        coef, rest = divmod(s[1] - s[0], ns[1] - ns[0])
        const = s[0] - coef * ns[0]
        if rest or coef <= 0 or s[2] != coef * ns[2] + const:
            raise BundleError(f"graph {k} of the call has a size that follows no rule a*n + c of n: it cannot be "
                              f"compiled for a range of n")
        symbols[j] = (coef, const)
    # compiled for the range asked (a delegate that plans memory for the largest size plans for its high)
    sizes = sizes.narrowed({j: (coef * dynamic.low + const, coef * dynamic.high + const)
                            for j, (coef, const) in symbols.items()})
    program = build_program(annotated(recorded[1], sizes, flats[1]), resolve(targets), run_inputs, quantize,
                            keep_artifacts=True)
    # the rules' ranges, narrowed by what the delegates took
    for j, (lo, hi) in narrowest(dict(enumerate(sizes.ranges)), program.bounds).items():
        coef, const = symbols[j]
        low.append(-((const - lo) // coef))
        high.append((hi - const) // coef)
    return Sized(program, symbols, max(low), min(high))


def sized_sources(traces: list, ns: list[int]) -> Any:
    """The first trace with each size a view source names (`logits = mm(…).view(1, n, vocab)`) as
    an expression in n, fitted on the three traces; any other difference between them is refused."""
    def walk(a: Any, b: Any, c: Any) -> Any:
        if isinstance(a, int) and not isinstance(a, bool) and isinstance(b, int) and isinstance(c, int):
            coef, rest = divmod(b - a, ns[1] - ns[0])
            const = a - coef * ns[0]
            if rest or c != coef * ns[2] + const:
                raise BundleError("a view Python took of a graph value has a size that follows no rule a*n + c")
            return expr(coef, const)
        if type(a) is tuple and type(b) is tuple and type(c) is tuple and len(a) == len(b) == len(c):
            if a and a[0] == "view":
                return ("view", walk(a[1], b[1], c[1]), *(tuple(walk(x, y, z) for x, y, z in zip(*f))
                                                         for f in zip(a[2:4], b[2:4], c[2:4])), walk(a[4], b[4], c[4]))
            if a and a[0] == "const":
                if not (a[1] is b[1] is c[1]):
                    raise BundleError("the call reads other constants at other sizes")
                return a
            return tuple(walk(x, y, z) for x, y, z in zip(a, b, c))
        if a != b or a != c:
            raise BundleError(f"the call differs between n = {ns[0]} and n = {ns[2]} in more than sizes "
                              f"({a!r} / {c!r}): it cannot be compiled for a range of n")
        return a

    first = traces[0]
    outputs = walk(first.outputs, traces[1].outputs, traces[2].outputs)
    calls = tuple(replace(s, sources=walk(s.sources, t.sources, u.sources))
                  for s, t, u in zip(first.calls, traces[1].calls, traces[2].calls))
    if any(s.reads != t.reads or s.reads != u.reads for s, t, u in zip(first.calls, traces[1].calls, traces[2].calls)):
        raise BundleError("the model reads values that differ between sizes to choose its path: it cannot be compiled "
                          "for a range of n")
    return calls, outputs

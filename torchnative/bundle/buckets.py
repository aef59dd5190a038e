"""A range of sizes on delegates that compile static shapes (QNN/HTP, Core ML, IREE, candle):
*buckets* (`capture-and-compile --dynamic input_ids:1,attention_mask:1=2..512 --targets qnn`).

The call is compiled at a few sizes of n: powers of two from 16 below the range's high, and the
high itself. A call at n runs the smallest bucket above it, its dynamic dims padded with zeros up
to the bucket's size, and its outputs are sliced back to n along the dims that follow n. The
attention mask's zeros keep the padded positions out of the real ones; a model that does not mask
them would change its outputs, so the build compares, on eager, each bucket's padded outputs with
the unpadded ones and refuses a model where they differ.

A bucket is captured padded, and models take another path when nothing is padded (transformers
drops an all-ones mask), so n equal to a bucket's size runs the next bucket up; n equal to the
range's high, the top bucket's own size, runs a bucket captured unpadded.
"""
from __future__ import annotations

from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchnative.bundle.dynamic import Dynamic, evaluate, expr, resized
from torchnative.bundle.format import BundleError

FIRST = 16  # the smallest bucket: below it, padding costs less than another compile
MASK = "attention_mask"
RTOL, ATOL = 1e-4, 1e-5  # padded vs unpadded on eager: the same sums, another order


def sizes(dynamic: Dynamic) -> list[tuple[int, bool]]:
    """The buckets as (size, padded), smallest first."""
    found, b = [], FIRST
    while b < dynamic.high:
        if b > dynamic.low:
            found.append((b, True))
        b *= 2
    return found + [(dynamic.high, True), (dynamic.high, False)]


def serves(size: int, padded: bool, n: int) -> bool:
    """Does the bucket run n: a padded one the sizes below its own, the other its own."""
    return n < size if padded else n == size


def pad(inputs: dict[str, Any], dims: tuple[tuple[str, int], ...], size: int) -> dict[str, Any]:
    """The inputs with the dims that share n padded with zeros to `size`."""
    out = dict(inputs)
    for name, d in dims:
        t = inputs[name]
        shape = list(t.shape)
        shape[d] = size - shape[d]
        out[name] = torch.cat([t, t.new_zeros(shape)], d)
    return out


def cut(value: torch.Tensor, slices: list[list], n: int) -> torch.Tensor:
    """An output of a padded bucket at n: its dims that follow n, sliced to their size at n."""
    for d, size in slices:
        value = value.narrow(d, 0, evaluate(size, n))
    return value


def check_masked(dynamic: Dynamic) -> None:
    if not any(name == MASK for name, _ in dynamic.dims):
        raise BundleError(f"the targets compile static shapes: a range of n runs as buckets padded to the next size, "
                          f"with {MASK} masking the padding out, and --dynamic names no {MASK} dim; add "
                          f"{MASK}:1 to it, or choose targets that take sizes that vary (ort, xnnpack)")


def _outputs(model: torch.nn.Module, inputs: dict[str, Any]) -> list:
    with torch.no_grad():
        return pytree.tree_leaves(model(**inputs))


def output_slices(model: torch.nn.Module, inputs: dict[str, Any], dynamic: Dynamic, n: int) -> list[list]:
    """Per output, the dims that follow n as (dim, expression in n): from eager's outputs at n and
    n + 1."""
    a, b = (_outputs(model, resized(inputs, dynamic, m)) for m in (n, n + 1))
    slices = []
    for x, y in zip(a, b):
        if not isinstance(x, torch.Tensor):
            slices.append([])
            continue
        if x.dim() != y.dim():
            raise BundleError("an output's rank changes with n: the call cannot run as buckets")
        slices.append([[d, expr(q - p, p - (q - p) * n)] for d, (p, q) in enumerate(zip(x.shape, y.shape)) if p != q])
    return slices


def check_padding(model: torch.nn.Module, inputs: dict[str, Any], dynamic: Dynamic, n: int, size: int,
                  names: list[str], slices: list[list]) -> list:
    """Eager's outputs at n padded to `size`, cut back to n, against the unpadded ones; the padded
    outputs (the bucket's reference). A model whose outputs the padding changes is refused."""
    at_n = resized(inputs, dynamic, n)
    padded = _outputs(model, pad(at_n, dynamic.dims, size))
    for name, want, got, s in zip(names, _outputs(model, at_n), padded, slices):
        if not isinstance(want, torch.Tensor):
            continue
        got = cut(got, s, n)
        if got.shape != want.shape or not torch.allclose(got.double(), want.double(), rtol=RTOL, atol=ATOL):
            worst = (got.double() - want.double()).abs().max().item() if got.shape == want.shape else float("nan")
            raise BundleError(f"padding n = {n} to {size} changes output {name!r} at the real positions (max abs "
                              f"diff {worst:.3g}): {type(model).__name__} does not mask the padded positions out, "
                              f"so it cannot run as buckets on static-shape targets; use targets that take sizes "
                              f"that vary (ort, xnnpack)")
    return padded

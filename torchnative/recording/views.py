"""Views recorded lazily: a view is (root base, chain of view ops). Reading it after its base
changed replays the chain; writing it scatters the new value back through the chain's inverse.
"""
from __future__ import annotations

from typing import Callable

import torch

from torchnative.recording.meta import Unrecordable

aten = torch.ops.aten

Chain = tuple  # ((op, args_after_self, kwargs), ...)

_RESHAPES = frozenset({
    aten.view.default, aten._unsafe_view.default, aten.alias.default, aten.unsqueeze.default,
    aten.squeeze.default, aten.squeeze.dim, aten.squeeze.dims, aten.expand.default,
    aten.detach.default,
})
_SCATTERS = {
    aten.slice.Tensor: aten.slice_scatter.default,
    aten.select.int: aten.select_scatter.default,
    aten.diagonal.default: aten.diagonal_scatter.default,
    aten.as_strided.default: aten.as_strided_scatter.default,
}


def apply(call: Callable, base, chain: Chain):
    """The chain's view ops, in order, on `base` (through `call`: recorded when it records)."""
    v = base
    for op, rest, kwargs in chain:
        v = call(op, (v, *rest), kwargs)
    return v


def _call(op, args: tuple, kwargs: dict):
    return op(*args, **kwargs)


def materialize(base: torch.Tensor, chain: Chain) -> torch.Tensor:
    """The chain's views of the real `base`, registered as views of it (`_base`) even when a cut
    inside the dispatcher runs this, below the ADInplaceOrView key that registers them: the
    recorder finds the aliases of a real tensor, to see writes through them, by `_base`."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return apply(_call, base, chain)


def _inverse(call: Callable, op, rest, kwargs, before, src):
    scatter = _SCATTERS.get(op)
    if scatter is not None:
        return call(scatter, (before, src, *rest), kwargs)
    if op in _RESHAPES:
        if op is aten.expand.default and tuple(before.shape) != tuple(src.shape):
            raise Unrecordable("in-place write into an expanded view")
        return call(aten.view.default, (src, list(before.shape)), {})
    if op is aten.permute.default:
        dims = [d % before.dim() for d in rest[0]] if before.dim() else []
        inverse = [dims.index(i) for i in range(len(dims))]
        return call(aten.permute.default, (src, inverse), {})
    raise Unrecordable(f"in-place write through a {op} view")


def scatter(call: Callable, base, chain: Chain, new):
    """The new value of `base` after the view `replay(base, chain)` is overwritten by `new`."""
    befores = [base]
    for op, rest, kwargs in chain[:-1]:
        befores.append(call(op, (befores[-1], *rest), kwargs))
    src = new
    for (op, rest, kwargs), before in zip(reversed(chain), reversed(befores)):
        src = _inverse(call, op, rest, kwargs, before, src)
    return src

"""What the door does with each aten op: record it, decompose it, functionalize it, or cut.

Classification is computed once per OpOverload from its schema and tags and cached, so the
door pays one dict lookup per op.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable

import torch
from torch._decomp import core_aten_decompositions

aten = torch.ops.aten


class Kind(enum.Enum):
    RECORD = "record"          # Core ATen op (or kept composite): becomes a graph node
    DECOMPOSE = "decompose"    # run its decomposition; the ops it calls pass the door again
    DIRECT = "direct"          # run a decomposition of ours inside the recorder
    INPLACE = "inplace"        # record the functional variant, then write the result back
    RESHAPE = "reshape"        # in-place metadata change (squeeze_, t_, ...): record the view
    IDENTITY = "identity"      # returns its argument (lift_fresh of a fresh literal)
    ANSWER = "answer"          # a metadata query answered without data
    RANDOM = "random"          # draws from the global generator: runs now, as eager would
    READ = "read"              # returns a Python value from tensor data: cuts unless the data is constant
    CUT = "cut"                # needs concrete data, or nothing can record it: run eagerly


@dataclass(frozen=True)
class OpClass:
    kind: Kind
    is_view: bool = False
    decomposition: Callable | None = None
    functional: torch._ops.OpOverload | None = None
    reason: str = ""


# Fused forwards whose backward is fused too: decomposing them below autograd gives the backward
# kernel saved values it was not written for (gradients off by 0.045 in the prototype), and
# delegates want them whole anyway. They stay one named composite node.
KEPT_COMPOSITES = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})

# Output shape depends on the data.
DATA_DEPENDENT = frozenset({
    aten.nonzero.default, aten.masked_select.default, aten.unique_dim.default,
    aten._unique.default, aten._unique2.default, aten.unique_consecutive.default,
    aten.repeat_interleave.Tensor, aten.bincount.default, aten.nonzero_numpy.default,
    aten.argwhere.default,
})


# Direct decompositions run inside the recorder (`call` records an op) without another pass
# through the dispatcher; they cover the hottest non-core ops and the multi-output views, which
# become single-output views so every recorded view has one base and an invertible chain.
def _split_with_sizes(call, x, split_sizes, dim=0):
    out, start = [], 0
    for n in split_sizes:
        out.append(call(aten.slice.Tensor, (x, dim, start, start + n)))
        start += n
    return out


def _split(call, x, split_size, dim=0):
    size = x.shape[dim]
    sizes = [min(split_size, size - s) for s in range(0, size, split_size)] if size else [0]
    return _split_with_sizes(call, x, sizes, dim)


def _unbind(call, x, dim=0):
    return [call(aten.select.int, (x, dim, i)) for i in range(x.shape[dim])]


def _transpose(call, x, dim0, dim1):
    n = x.dim()
    perm = list(range(n))
    if n:
        perm[dim0 % n], perm[dim1 % n] = perm[dim1 % n], perm[dim0 % n]
    return call(aten.permute.default, (x, perm))


def _t(call, x):
    return _transpose(call, x, 0, 1) if x.dim() == 2 else call(aten.alias.default, (x,))


def _unsafe_view(call, x, size):
    return call(aten.view.default, (x, size))


def _to_dtype(call, x, dtype, non_blocking=False, copy=False, memory_format=None):
    if x.dtype == dtype and not copy and memory_format in (None, torch.preserve_format):
        return x
    kwargs = {"dtype": dtype} if memory_format is None else {"dtype": dtype, "memory_format": memory_format}
    return call(aten._to_copy.default, (x,), kwargs)


DIRECT_DECOMPOSITIONS: dict = {
    aten.split_with_sizes.default: _split_with_sizes,
    aten.unsafe_split_with_sizes.default: _split_with_sizes,
    aten.split.Tensor: _split,
    aten.unsafe_split.Tensor: _split,
    aten.unbind.int: _unbind,
    aten.transpose.int: _transpose,
    aten.t.default: _t,
    aten._unsafe_view.default: _unsafe_view,
    aten.to.dtype: _to_dtype,
}


def _native_batch_norm(x, weight, bias, running_mean, running_var, training, momentum, eps):
    # torch 2.13's schema does not mark the running stats as written, yet training mode updates
    # them in place: make that write explicit so it is recorded as a state update.
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, training, momentum, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training.default(
            x, weight, bias, running_mean, running_var, momentum, eps)
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


# Decompositions of ours that run through the dispatcher like torch's own.
DOOR_DECOMPOSITIONS: dict = {
    aten.native_batch_norm.default: _native_batch_norm,
}

_TABLE = core_aten_decompositions()
_CLASSES: dict = {}


def classify(op: torch._ops.OpOverload) -> OpClass:
    # keyed by id: OpOverloads are interned for the life of the process, and their __hash__ is
    # Python code that the door would otherwise pay on every op
    c = _CLASSES.get(id(op))
    if c is None:
        c = _CLASSES[id(op)] = _classify(op)
    return c


def _returns_tensors(schema) -> bool:
    return all(str(r.type) in ("Tensor", "Tensor?", "List[Tensor]", "Optional[Tensor]") for r in schema.returns) \
        and len(schema.returns) > 0


def _functional_variant(op: torch._ops.OpOverload):
    name = op._schema.name.split("::")[1]
    if not name.endswith("_"):
        return None
    packet = getattr(aten, name[:-1], None)
    if packet is None:
        return None
    return getattr(packet, op._overloadname, None)


_RESHAPES_INPLACE = frozenset({"squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_"})


def _classify(op: torch._ops.OpOverload) -> OpClass:
    schema = op._schema
    name = schema.name.split("::")[1]
    if name in _RESHAPES_INPLACE:
        functional = _functional_variant(op)
        if functional is not None:
            return OpClass(Kind.RESHAPE, functional=functional)
    if op in KEPT_COMPOSITES:
        return OpClass(Kind.RECORD)
    if op is aten.lift_fresh.default:
        return OpClass(Kind.IDENTITY)
    if op is aten._has_compatible_shallow_copy_type.default:  # asked by `t.data = other`
        return OpClass(Kind.ANSWER, decomposition=lambda a, b: type(a) is type(b))
    if name in ("resize_", "set_", "resize_as_"):
        return OpClass(Kind.CUT, reason=f"in-place storage change: {op}")
    if op in DIRECT_DECOMPOSITIONS:
        return OpClass(Kind.DIRECT, decomposition=DIRECT_DECOMPOSITIONS[op])
    if op in DOOR_DECOMPOSITIONS:
        return OpClass(Kind.DECOMPOSE, decomposition=DOOR_DECOMPOSITIONS[op])
    if torch.Tag.nondeterministic_seeded in op.tags:
        # Recorded lazily, a random op would draw at flush time, after Python may have reseeded
        # or restored the generator (fork_rng, manual_seed); so it runs when it is called.
        return OpClass(Kind.RANDOM, reason=f"random op on a pending tensor: {op}")
    if not _returns_tensors(schema):
        return OpClass(Kind.READ, reason=f"data read: {op} returns a Python value")
    if op in DATA_DEPENDENT:
        return OpClass(Kind.CUT, reason=f"data-dependent output shape: {op}")
    if schema.is_mutable:
        first = schema.arguments[0] if schema.arguments else None
        in_place = (first is not None and first.alias_info is not None and first.alias_info.is_write
                    and sum(1 for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write) == 1)
        functional = _functional_variant(op) if in_place else None
        if functional is not None and not functional._schema.is_mutable:
            return OpClass(Kind.INPLACE, functional=functional)
        if op in _TABLE:
            return OpClass(Kind.DECOMPOSE, decomposition=_TABLE[op])
        return OpClass(Kind.CUT, reason=f"no functional form: {op} mutates an argument that is not self")
    if torch.Tag.core in op.tags:
        return OpClass(Kind.RECORD, is_view=op.is_view)
    if op in _TABLE:
        return OpClass(Kind.DECOMPOSE, decomposition=_TABLE[op])
    if torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd"):
        return OpClass(Kind.DECOMPOSE, decomposition=op.decompose)
    # Not Core ATen and no decomposition: recorded as is; only the eager delegate will take it.
    return OpClass(Kind.RECORD, is_view=op.is_view)

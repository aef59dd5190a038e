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
    ASIDE = "aside"            # touches no tensor data (a profiler range): runs now, the graph goes on
    CUT = "cut"                # needs concrete data, or nothing can record it: run eagerly


@dataclass(frozen=True)
class OpClass:
    kind: Kind
    is_view: bool = False
    decomposition: Callable | None = None
    functional: torch._ops.OpOverload | None = None
    reason: str = ""
    # the position of a storage offset it takes (as_strided): an offset where a tensor sits in its
    # storage, which recording leaves out of an argument's key (Recorder.new_input)
    offset_at: int | None = None


# Fused forwards whose backward is fused too: decomposing them below autograd gives the backward
# kernel saved values it was not written for (gradients off by 0.045 in the prototype), and
# delegates want them whole anyway. They stay one named composite node.
KEPT_COMPOSITES = frozenset({
    aten._scaled_dot_product_flash_attention_for_cpu.default,
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
})

# Non-Core ops recorded whole, not decomposed: torch's decomposition of each rounds differently
# from its CPU kernel, so a graph that eager runs would not be eager's bit for bit (on PyTorch's
# OpInfo samples and random float32 inputs: silu, softplus, mish, addcmul, lerp, nll_loss,
# binary_cross_entropy, linspace 1e-7 to 2e-6 apart, mv 5e-5 and dot 9e-5 in another summation
# order; the backward kernels 1e-8 to 4e-6; multilabel_margin_loss's is wrong where a row of
# targets ends before its last slot). ONNX takes each but that one: torchlib's translation, ours
# (delegates.onnx_export), or the exporter's decomposition of it with torch's table. A delegate
# whose table lacks one leaves it to eager (xnnpack and candle all, coreml most) unless it lowers
# DECOMPOSITIONS[op].
# They round differently too, yet stay decomposed: logaddexp(2) (torchlib's log(exp(a) + exp(b))
# overflows), upsample_linear1d (torchlib's is wrong at a fractional scale), and ops ONNX Runtime
# would decline whole or in the exporter's decomposition: linalg_cross, renorm (linalg_vector_norm),
# special_log_ndtr, special_xlog1py.
KEPT_WHOLE = frozenset({
    aten.silu.default, aten.softplus.default, aten.mish.default, aten.log_sigmoid_forward.default,
    aten.addcmul.default, aten.lerp.Scalar, aten.lerp.Tensor, aten.sinc.default, aten.xlogy.Tensor,
    aten.std.correction, aten.std_mean.correction, aten.mv.default, aten.dot.default, aten.vdot.default,
    aten.addr.default, aten.nll_loss_forward.default, aten.nll_loss2d_forward.default,
    aten.binary_cross_entropy.default, aten.soft_margin_loss.default, aten.multi_margin_loss.default,
    aten.multilabel_margin_loss_forward.default,
    aten.linspace.default, aten.linspace.Tensor_Tensor, aten.linspace.Tensor_Scalar, aten.linspace.Scalar_Tensor,
    aten.logspace.default, aten.logspace.Tensor_Tensor, aten.logspace.Tensor_Scalar, aten.logspace.Scalar_Tensor,
    # backward kernels, which a graph holds when it takes gradients (a fast-weight layer's update)
    aten.silu_backward.default, aten.mish_backward.default, aten.softplus_backward.default,
    aten.log_sigmoid_backward.default, aten.gelu_backward.default, aten.elu_backward.default,
    aten.sigmoid_backward.default, aten.tanh_backward.default, aten._softmax_backward_data.default,
    aten._log_softmax_backward_data.default, aten.native_batch_norm_backward.default,
    aten.soft_margin_loss_backward.default,
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
    # Without statistics to update the momentum is not read: recorded as 0, so a momentum set
    # every call (DUA's, read by the eval-mode calls between its updates too) is neither a new
    # graph per value nor a float input that keeps each such BatchNorm off ONNX Runtime.
    if running_mean is None:
        return aten._native_batch_norm_legit.no_stats(x, weight, bias, training, 0.0, eps)
    if not training:
        return aten._native_batch_norm_legit_no_training.default(x, weight, bias, running_mean, running_var, 0.0, eps)
    out, mean, rstd, new_mean, new_var = aten._native_batch_norm_legit_functional.default(
        x, weight, bias, running_mean, running_var, True, momentum, eps)
    running_mean.copy_(new_mean)
    running_var.copy_(new_var)
    return out, mean, rstd


# Decompositions of ours that run through the dispatcher like torch's own.
DOOR_DECOMPOSITIONS: dict = {
    aten.native_batch_norm.default: _native_batch_norm,
    # batch_norm's choice of kernel, which the door sees under inference_mode (autograd no longer
    # decomposes it above the door). It returns that kernel's index, an int no data determines:
    # classified as a data read it cut the graph, and the eager kernel then wrote the running
    # statistics where no program's guard sees it (an eval program kept them baked: off by 0.3-5).
    aten._batch_norm_impl_index.default: aten._batch_norm_impl_index.default.decompose,
}

# torch's, which the door applies to non-Core ops: its aten table as a plain dict. Looking an op up
# in the table torch returns first collects every CompositeImplicitAutograd op of every namespace
# (~20 ms, in the first call of the first model); the door decomposes those of other namespaces
# itself (`op.decompose`, the last case of `_classify`)
DECOMPOSITIONS: dict = core_aten_decompositions().decomp_table
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


_TAKES_OFFSET = {aten.as_strided.default: 3, aten.as_strided_scatter.default: 4}


def explicit_offset(c: OpClass, args: tuple, kwargs: dict) -> bool:
    """Does this call of an op that takes a storage offset give one (not None: self's own)?"""
    if len(args) > c.offset_at:
        return args[c.offset_at] is not None
    return kwargs.get("storage_offset") is not None


_RESHAPES_INPLACE = frozenset({"squeeze_", "unsqueeze_", "t_", "transpose_", "swapdims_", "swapaxes_", "as_strided_"})


def _composite(op: torch._ops.OpOverload) -> bool:
    return torch._C._dispatch_has_kernel_for_dispatch_key(op.name(), "CompositeImplicitAutograd")


def _classify(op: torch._ops.OpOverload) -> OpClass:
    schema = op._schema
    namespace, name = schema.name.split("::")
    if namespace == "profiler":  # record_function's range: enter and exit take and return no tensor
        return OpClass(Kind.ASIDE)
    if name in _RESHAPES_INPLACE:
        functional = _functional_variant(op)
        if functional is not None:
            return OpClass(Kind.RESHAPE, functional=functional)
    if op in KEPT_COMPOSITES or op in KEPT_WHOLE:
        return OpClass(Kind.RECORD)
    if op is aten.lift_fresh.default:
        return OpClass(Kind.IDENTITY)
    if op is aten.detach_.default:
        # autograd's part (the tensor's own grad state) is done above the door; below it no data
        # changes. Reaches the door in inference mode (`torch.tensor([])`: a KV cache's lazy init)
        return OpClass(Kind.IDENTITY)
    if op is aten.detach.default:
        # kept as itself, not torch's `alias` decomposition: a graph differentiated as recorded
        # (build/differentiable.py) must stop gradients where the model did (RT-DETR detaches its
        # reference points between decoder layers); passes.prepare makes it an alias for delegates
        return OpClass(Kind.RECORD, is_view=True)
    if op is aten._has_compatible_shallow_copy_type.default:  # asked by `t.data = other`
        return OpClass(Kind.ANSWER, decomposition=lambda a, b: type(a) is type(b))
    if name in ("resize_", "set_", "resize_as_"):
        return OpClass(Kind.CUT, reason=f"in-place storage change: {op}")
    if op in DIRECT_DECOMPOSITIONS:
        return OpClass(Kind.DIRECT, decomposition=DIRECT_DECOMPOSITIONS[op])
    if op in DOOR_DECOMPOSITIONS:
        return OpClass(Kind.DECOMPOSE, decomposition=DOOR_DECOMPOSITIONS[op])
    if _composite(op) and torch.Tag.core not in op.tags and not schema.is_mutable:
        # decomposed above the door (at the Autograd key), except in inference mode, where it
        # reaches the door whole: eval-mode dropout and SDPA (tagged random) cut every transformer
        # layer's graph there, and `if mask.any():` (is_nonzero, a read) ran outside any graph
        return OpClass(Kind.DECOMPOSE, decomposition=DECOMPOSITIONS.get(op, op.decompose))
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
        if op in DECOMPOSITIONS:
            return OpClass(Kind.DECOMPOSE, decomposition=DECOMPOSITIONS[op])
        return OpClass(Kind.CUT, reason=f"no functional form: {op} mutates an argument that is not self")
    if op in _TAKES_OFFSET:
        return OpClass(Kind.RECORD, is_view=op.is_view, offset_at=_TAKES_OFFSET[op])
    if torch.Tag.core in op.tags:
        return OpClass(Kind.RECORD, is_view=op.is_view)
    if op in DECOMPOSITIONS:
        return OpClass(Kind.DECOMPOSE, decomposition=DECOMPOSITIONS[op])
    # Not Core ATen and no decomposition: recorded as is; only the eager delegate will take it.
    return OpClass(Kind.RECORD, is_view=op.is_view)

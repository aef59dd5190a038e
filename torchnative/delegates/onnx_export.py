"""A CapturedGraph as an ONNX model, for the delegates that run ONNX (ort, qnn): torch.onnx's
torchlib translation of its ExportedProgram, with our own translations where torchlib's is slow or
missing (the composites of passes.fuse, attention over a KV cache or grouped KV heads, index_put
as one ScatterND for passes.state, var and var_mean), the opset, and which aten ops the export
translates at all."""
from __future__ import annotations

import functools
import logging
import math
import operator
from unittest import mock

import torch
import torch.fx as fx
from torch._decomp import decomposition_table

from torchnative.ir import CapturedGraph
from torchnative.sizes import exported_ranges, is_symbolic
from torchnative.passes.fuse import gelu_tanh_op, quantized_mm_op, rms_norm_op, rope_op
from torchnative.recording.ops import DECOMPOSITIONS, KEPT_WHOLE
from torchnative.quiet import quiet

SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
_COMPOSITE_OPS = {rms_norm_op, rope_op, gelu_tanh_op}


def saved_read(node: fx.Node) -> bool:
    """Is an output past the first read: what autograd saves for the backward (SDPA's logsumexp,
    batch norm's saved statistics), in a graph recorded with grad enabled?"""
    return any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users)


def _ours_attention(node: fx.Node) -> bool:
    """Attention with a mask (a row it masks whole is 0 in eager's kernel, NaN in torchlib's
    translation), of fewer queries than keys (a step over a KV cache: torchlib's translation
    passes over the whole cache three times; ours ran a GPT-2 decode step 7.8 % faster, but BERT
    4.6 % and GPT-2 prefill 2.6 % slower), with grouped KV heads (torchlib's takes none), or
    whose logsumexp autograd saves (torchlib's computes the output only)."""
    if node.kwargs.get("attn_mask") is not None or saved_read(node):
        return True
    q, k = (a.meta.get("val") for a in node.args[:2])
    return q is not None and k is not None and q.dim() == 4 and (q.shape[1] != k.shape[1] or q.shape[2] < k.shape[2])


def slice_write(node: fx.Node) -> bool:
    """index_put along one dim by a 1-D index (a KV cache written at its positions)."""
    given = [i for i in node.args[1] if i is not None]
    return len(given) == 1 and given[0].meta.get("val") is not None and given[0].meta["val"].dim() == 1 \
        and not given[0].meta["val"].dtype.is_floating_point and given[0].meta["val"].dtype != torch.bool


BATCH_NORM_EVAL = torch.ops.aten._native_batch_norm_legit_no_training.default
_SAVING_ATTENTION = "attention that computes the logsumexp a backward reads"  # a key of _translations()

# torchlib's translation is replaced only in graphs that have a node it handles badly
_OURS = {torch.ops.aten.index_put.default: slice_write, **{sdpa: _ours_attention for sdpa in SDPA},
         BATCH_NORM_EVAL: saved_read}


def _float64(node: fx.Node) -> bool:
    return node.meta["val"].dtype == torch.float64


def _total_weight_read(node: fx.Node) -> bool:
    return any(u.target is operator.getitem and u.args[1] == 1 and u.users for u in node.users)


def _always(node: fx.Node) -> bool:
    return True


# Batch norm on batch statistics (train mode, TENT, BN re-estimation): torchlib's translation
# disagrees with eager (OpInfo sweep), torch's decomposition (var_mean, rsqrt, the running stats'
# momentum update with the unbiased variance) does not. Left to eager, each one cut a ResNet's
# graph into a dozen partitions.
BATCH_NORM_TRAINING = frozenset({torch.ops.aten._native_batch_norm_legit_functional.default,
                                 torch.ops.aten._native_batch_norm_legit.no_stats})


# Ops the door keeps whole (recording.ops.KEPT_WHOLE) whose torchlib translation fails some nodes:
# a graph with such a node is decomposed for these ops, as the door would have recorded it
_DECOMPOSED_WHERE = {
    torch.ops.aten.softplus.default: _float64,  # ONNX Runtime has no float64 Softplus kernel
    torch.ops.aten.mish.default: _float64,  # ONNX defines Mish with Softplus
    # torchlib's total_weight (which nll_loss_backward divides by) is the output's size, not a sum of weights
    torch.ops.aten.nll_loss_forward.default: _total_weight_read,
    **{op: _always for op in BATCH_NORM_TRAINING},
}


@functools.cache
def _torchlib(opset: int):
    """torchlib's registry at `opset`, made once: torch.onnx.export makes it anew on every call.
    Made as `ONNXRegistry.from_torchlib` makes it, except that a function's ONNX signature is left
    to the export of a node that calls it (torch's graph builder infers it then, and the dispatch
    never reads it): inferring all ~500 parses each function's source (0.45 s; ~10 s on a
    background build's thread, whose Python runs in slices). Made here in the process that
    partitions (`translated`), before a background compile's fork, the forks have it too."""
    from onnxscript.function_libs.torch_lib import ops, registration  # noqa: F401 (importing ops registers them)
    from torch.onnx._internal.exporter import _registration
    from torch.onnx._internal.exporter._torchlib import _torchlib_registry

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    registry = _registration.ONNXRegistry()
    registry._opset_version = opset
    for meta in _torchlib_registry.get_torchlib_ops():
        registry._register(meta.fx_target, meta)
    for name, functions in registration.default_registry.items():
        target = None if name.startswith("internal::") else _registration._get_overload(name)
        if target is None:
            continue
        for function, is_complex in [(f, False) for f in functions.overloads] + [(f, True) for f in functions.complex]:
            registry._register(target, _registration.OnnxDecompMeta(
                onnx_function=function, fx_target=target, signature=None, is_complex=is_complex,
                skip_signature_inference=True))
    registry._cleanup_registry_based_on_opset_version()
    return registry


@functools.cache
def _translations() -> dict:
    """Our ONNX translations: the composites (passes.fuse) ONNX Runtime runs as one kernel
    (opset 23); attention and index_put where torchlib's are slow or missing (see _OURS); var and
    var_mean, which torchlib does not translate."""
    import numpy
    import onnx
    from onnxscript import opset23 as op

    def rms_norm(x, weight, eps: float):
        return op.RMSNormalization(x, weight, axis=-1, epsilon=eps, stash_type=1)

    def gelu_tanh(x):
        return op.Gelu(x, approximate="tanh")

    def rope(x, cos, sin):
        # the fusion proved cos and sin repeat their first half; ONNX's kernel reads that half,
        # [batch, positions, half] (cos is [batch or 1, 1, positions, head_size])
        size = x.shape[3]
        ints = lambda *v: op.Constant(value_ints=list(v))  # noqa: E731

        def half(t):
            t = op.Squeeze(op.Slice(t, ints(0), ints(size // 2), ints(3)), ints(1))
            return op.Expand(t, shape(dim(x, 0), dim(x, 2), size // 2))
        return op.RotaryEmbedding(x, half(cos), half(sin))

    def quantized_mm(x, q, scale, bias=None, bits: int = 4):
        # ONNX Runtime's low-bit kernels on q as it is; ort lays q out for them (low_bit_layouts).
        # int4: blockwise MatMulNBits (see INT4_ACCURACY_LEVEL). int8: per-channel MatMulInteger
        # on dynamically quantized activations (GPT-2's decode matmuls 2.5x faster than float32's)
        n, groups, group = q.shape
        if bits == 4:
            y = matmul_nbits(x, q, scale, K=groups * group, N=n, bits=4, block_size=group,
                                 accuracy_level=INT4_ACCURACY_LEVEL)
        else:
            xq, xscale, xzero = op18.DynamicQuantizeLinear(x)
            y = op18.Mul(op18.Cast(op18.MatMulInteger(xq, q, xzero), to=ir.DataType.FLOAT),
                         op18.Mul(xscale, op18.Reshape(scale, ints([-1]))))
        return y if bias is None else op18.Add(y, bias)

    def attention(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, attn_mask=None, scale=None):
        return attend(query, key, value, dropout_p, is_causal, attn_mask, scale, saving=False)

    def attention_saving(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, attn_mask=None, scale=None):
        return attend(query, key, value, dropout_p, is_causal, attn_mask, scale, saving=True)

    def attend(query, key, value, dropout_p, is_causal, attn_mask, scale, saving: bool):
        # softmax(q @ kᵀ · scale + mask) @ v in the form ONNX Runtime's optimizer fuses into one
        # FusedMatMul (transposed k, the scale as its alpha): torchlib's scales q and k by √scale
        # and transposes k itself, three passes over a KV cache per layer
        if dropout_p != 0.0:
            return torchlib_nn.aten__scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask, scale)
        # sizes are ints, or symbolic dims when the graph's sizes vary (torchnative.sizes): dim()
        # reads those off the tensor at run time
        batch, heads, length, size = (dim(query, d) for d in range(4))
        kv_heads, positions = key.shape[1], dim(key, 2)
        if kv_heads != query.shape[1]:  # grouped-query: query head h reads KV head h // (heads / kv_heads)
            def repeat(t):
                t = op18.Expand(op18.Unsqueeze(t, ints([2])), shape(batch, kv_heads, heads // kv_heads, positions, size))
                return op18.Reshape(t, shape(batch, heads, positions, -1))
            key, value = repeat(key), repeat(value)
        scale = 1.0 / math.sqrt(size) if scale is None else scale
        # scaled after the product, as torch's CPU kernel does (before it, OpInfo's large samples differ by 1e-5)
        # constants in the inputs' dtype (float64, float16: ONNX binds both operands to one type)
        like = lambda c: op18.CastLike(c, query)  # noqa: E731
        product = op18.MatMul(query, op18.Transpose(key, perm=[0, 1, 3, 2]))
        # the scale as a double, rounded to the inputs' dtype (1/√32 as a float32 attribute is 3e-9 off)
        scale = op18.Constant(value=onnx.numpy_helper.from_array(numpy.array(scale, numpy.float64)))
        scores = op18.Mul(product, like(scale))
        if is_causal and isinstance(length, int) and isinstance(positions, int):
            above = numpy.triu(numpy.full((length, positions), -numpy.inf, numpy.float32), 1)
            scores = op18.Add(scores, like(op18.Constant(value=onnx.numpy_helper.from_array(above))))
        elif is_causal:
            minus = onnx.numpy_helper.from_array(numpy.array([-numpy.inf], numpy.float32))
            scores = op18.Add(scores, like(op18.Trilu(op18.ConstantOfShape(shape(length, positions), value=minus),
                                                      ints([1]), upper=1)))
        if attn_mask is not None:
            scores = op18.Where(attn_mask, scores, like(op18.Constant(value_float=-math.inf))) \
                if attn_mask.dtype == onnx.TensorProto.BOOL else op18.Add(scores, attn_mask)
        out = op18.MatMul(op18.Softmax(scores, axis=-1), value)
        zero = op18.CastLike(op18.Constant(value_float=0.0), out)
        if attn_mask is not None:  # a query the mask hides from every key: eager's kernel gives 0, Softmax NaN
            out = op18.Where(masked_rows(attn_mask), zero, out)
        if not saving:  # no backward reads the logsumexp (ONNX Runtime keeps nodes no output needs)
            return out, op18.Expand(zero, shape(batch, heads, length))
        lse = op18.ReduceLogSumExp(scores, ints([-1]), keepdims=0)
        if attn_mask is not None:  # eager's kernel: 0 for a row the mask hides whole, as its output
            lse = op18.Where(op18.Squeeze(masked_rows(attn_mask), ints([-1])), zero, lse)
        return out, lse

    def batch_norm_eval(x, weight=None, bias=None, running_mean=None, running_var=None, momentum: float = 0.9,
                        eps: float = 1e-05):
        # eager's saved mean and invstd of an eval-mode batch norm are empty (its backward reads
        # the running statistics); torchlib's are the batch's
        out = torchlib_core.aten__native_batch_norm_no_training(x, weight, bias, running_mean, running_var, momentum, eps)[0]
        empty = lambda: op18.CastLike(op18.Constant(value=onnx.numpy_helper.from_array(numpy.zeros(0, numpy.float32))), x)  # noqa: E731
        return out, empty(), empty()

    def masked_rows(mask):
        """[..., queries, 1]: True where the mask lets a query see no key (a padded position);
        the mask is float, as the kernel takes it (SDPA's bool masks reach it as 0 and -inf)."""
        return op18.Equal(op18.ReduceMax(mask, ints([-1]), keepdims=1), op18.CastLike(op18.Constant(value_float=-math.inf), mask))

    def index_put(data, indices, values, accumulate: bool = False):
        # torchlib's moves the indexed dim first and back: two transposes of the whole cache per
        # write, 15 % of a GPT-2 decode step. ScatterND with an index tuple per leading position
        # writes whole trailing slices where they are
        at = next((d for d, i in enumerate(indices) if i is not None), None)
        if at is None or sum(i is not None for i in indices) != 1 or len(indices[at].shape) != 1:
            return torchlib_core.aten_index_put(data, indices, values, accumulate)
        lead = [*data.shape[:at], indices[at].shape[0]]
        if not all(isinstance(n, int) for n in [*lead, *data.shape[at + 1:]]):  # sizes that vary: a grid of none
            return torchlib_core.aten_index_put(data, indices, values, accumulate)
        grid = numpy.stack(numpy.meshgrid(*(numpy.arange(n) for n in lead), indexing="ij"), -1)[..., :-1]
        where = op18.Concat(op18.Constant(value=onnx.numpy_helper.from_array(grid.astype(numpy.int64))),
                            op18.Expand(op18.Reshape(indices[at], ints([1] * at + [-1, 1])), ints([*lead, 1])), axis=-1)
        return op18.ScatterND(data, where, op18.Expand(values, ints([*lead, *data.shape[at + 1:]])),
                              reduction="add" if accumulate else "none")

    # gradients the exporter leaves undecomposed though torch's table has them (each has a
    # CompositeImplicitAutograd kernel beside its CPU one), in the op order of that decomposition
    def silu_backward(grad, x):
        sigmoid = op18.Sigmoid(x)
        one = op18.CastLike(op18.Constant(value_float=1.0), x)
        return op18.Mul(op18.Mul(grad, sigmoid), op18.Add(one, op18.Mul(x, op18.Sub(one, sigmoid))))

    def mish_backward(grad, x):
        one = op18.CastLike(op18.Constant(value_float=1.0), x)
        tanh_softplus = op18.Tanh(op18.Log(op18.Add(op18.Exp(x), one)))  # not Softplus: no float64 kernel
        out = op18.Mul(op18.Mul(x, op18.Sigmoid(x)), op18.Sub(one, op18.Mul(tanh_softplus, tanh_softplus)))
        return op18.Mul(grad, op18.Add(tanh_softplus, out))

    def moments(x, dim, correction, keepdim: bool):
        # as torch's kernel: the squared deviations from the mean summed, over max(0, n - correction)
        # (torchlib registers none; its unregistered one rescales the mean square, one rounding
        # more, counts dim=[] as one element, and lets n - correction go negative)
        rank = len(x.shape)
        axes = ints([d % rank for d in dim] if dim and rank else list(range(rank)))
        given = x
        if x.dtype in (ir.DataType.FLOAT16, ir.DataType.BFLOAT16):  # torch accumulates them in float32
            x = op18.Cast(x, to=ir.DataType.FLOAT)
        n = op18.CastLike(op18.ReduceProd(op18.Gather(op18.Shape(x), axes), keepdims=0), x)
        mean = op18.Div(op18.ReduceSum(x, axes, keepdims=1), n)  # not ReduceMean: nan over no elements, as torch's
        deviation = op18.Sub(x, mean)
        total = op18.ReduceSum(op18.Mul(deviation, deviation), axes, keepdims=int(keepdim))
        correction = op18.CastLike(op18.Constant(value_float=1.0 if correction is None else float(correction)), x)
        left = op18.Sub(n, correction)
        var = op18.Div(total, op18.Max(left, op18.CastLike(op18.Constant(value_float=0.0), x)))
        if not keepdim and rank:
            mean = op18.Squeeze(mean, axes)
        if x is not given:
            var, mean = op18.CastLike(var, given), op18.CastLike(mean, given)
        return var, mean

    def var(x, dim=None, correction=None, keepdim: bool = False):
        return moments(x, dim, correction, keepdim)[0]

    def var_mean(x, dim=None, correction=None, keepdim: bool = False):
        return moments(x, dim, correction, keepdim)

    # ONNX Runtime's ReduceMax/Min and ArgMax/Min skip NaN; torch's propagate it (a NaN is the
    # extreme value, and its first index the arg): the translations say so where x is float
    def has_nan(x, axes, keepdim: bool):
        return op18.Cast(op18.ReduceMax(op18.Cast(op18.IsNaN(x), to=ir.DataType.FLOAT), axes, keepdims=int(keepdim)),
                         to=ir.DataType.BOOL)

    def extreme(reduce, x, dim, keepdim: bool):
        axes = ints([d % len(x.shape) for d in dim] if dim else list(range(len(x.shape))))
        values = reduce(x, axes, keepdims=int(keepdim))
        if x.dtype not in floats:
            return values
        return op18.Where(has_nan(x, axes, keepdim), op18.CastLike(op18.Constant(value_float=math.nan), x), values)

    def arg(find, x, dim, keepdim: bool):
        if dim is None:  # over the flattened tensor
            rank, x, dim = len(x.shape), op18.Reshape(x, ints([-1])), 0
            found = arg(find, x, 0, keepdim)
            return op18.Reshape(found, ints([1] * rank)) if keepdim else op18.Squeeze(found, ints([0]))
        found = find(x, axis=dim, keepdims=int(keepdim))
        if x.dtype not in floats:
            return found
        nan = op18.Cast(op18.IsNaN(x), to=ir.DataType.FLOAT)
        return op18.Where(has_nan(x, ints([dim]), keepdim), op18.ArgMax(nan, axis=dim, keepdims=int(keepdim)), found)

    def amax(x, dim=(), keepdim: bool = False):
        return extreme(op18.ReduceMax, x, dim, keepdim)

    def amin(x, dim=(), keepdim: bool = False):
        return extreme(op18.ReduceMin, x, dim, keepdim)

    def argmax(x, dim=None, keepdim: bool = False):
        return arg(op18.ArgMax, x, dim, keepdim)

    def argmin(x, dim=None, keepdim: bool = False):
        return arg(op18.ArgMin, x, dim, keepdim)

    def sign(x):  # torch's sign of NaN is 0, ONNX's NaN
        if x.dtype not in floats:
            return op18.Sign(x)
        return op18.Where(op18.IsNaN(x), op18.CastLike(op18.Constant(value_float=0.0), x), op18.Sign(x))

    def max_dim(x, dim: int, keepdim: bool = False):
        return amax(x, [dim], keepdim), argmax(x, dim, keepdim)

    def min_dim(x, dim: int, keepdim: bool = False):
        return amin(x, [dim], keepdim), argmin(x, dim, keepdim)

    ints = lambda v: op18.Constant(value_ints=v)  # noqa: E731

    def dim(x, d: int):
        """x's size d: an int, or a 1-element tensor read at run time when the size varies."""
        n = x.shape[d]
        return n if isinstance(n, int) else op18.Slice(op18.Shape(x), ints([d]), ints([d + 1]))

    def shape(*sizes):
        """A shape of ints and sizes read at run time (dim)."""
        if all(isinstance(n, int) for n in sizes):
            return ints(list(sizes))
        return op18.Concat(*[ints([n]) if isinstance(n, int) else n for n in sizes], axis=0)
    import onnxscript
    from onnxscript import ir
    from onnxscript import opset18 as op18  # torchlib's opset: up-converts to the graph's
    from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn
    floats = (ir.DataType.FLOAT, ir.DataType.DOUBLE, ir.DataType.FLOAT16, ir.DataType.BFLOAT16)
    matmul_nbits = onnxscript.values.Op(onnxscript.values.Opset("com.microsoft", 1), "MatMulNBits", _matmul_nbits_schema())

    return {rms_norm_op: rms_norm, gelu_tanh_op: gelu_tanh, rope_op: rope, quantized_mm_op: quantized_mm, torch.ops.aten.index_put.default: index_put,
            torch.ops.aten.var.correction: var, torch.ops.aten.var_mean.correction: var_mean,
            torch.ops.aten.silu_backward.default: silu_backward, torch.ops.aten.mish_backward.default: mish_backward,
            torch.ops.aten.amax.default: amax, torch.ops.aten.amin.default: amin, torch.ops.aten.argmax.default: argmax,
            torch.ops.aten.argmin.default: argmin, torch.ops.aten.max.dim: max_dim, torch.ops.aten.min.dim: min_dim,
            torch.ops.aten.sign.default: sign, BATCH_NORM_EVAL: batch_norm_eval,
            **{sdpa: attention for sdpa in SDPA}, _SAVING_ATTENTION: attention_saving}


# MatMulNBits on its int8 path (level 4): the activations quantized in blocks of 32 along K
# (passes.quantize.low_bit_activations), integer dot products (VNNI here), GPT-2 small's decode
# 1.4x faster than level 1's float32 compute. Each matmul is the a8 reference's to float32
# rounding (checked over GPT-2's shapes with outliers of 100x); what the activations' rounding
# costs is the test's and the benchmark's bound. (A session read GPT-2's logits 1.37 off after a
# prefill as a wrong result: its prefill's greedy token had flipped, a near tie, and the decode
# step was given another token.)
INT4_ACCURACY_LEVEL = 4


def _matmul_nbits_schema():
    """ONNX Runtime's contrib op, as far as the translation uses it (onnx registers no contrib
    schemas, and onnxscript builds a node from its schema)."""
    from onnx.defs import OpSchema

    ints = [OpSchema.Attribute(a, OpSchema.AttrType.INT, "", required=a != "accuracy_level")
            for a in ("K", "N", "bits", "block_size", "accuracy_level")]
    return OpSchema("MatMulNBits", "com.microsoft", 1, doc="ONNX Runtime's blockwise low-bit matmul",
                    inputs=[OpSchema.FormalParameter("A", "T1"), OpSchema.FormalParameter("B", "T2"),
                            OpSchema.FormalParameter("scales", "T1")],
                    outputs=[OpSchema.FormalParameter("Y", "T1")],
                    type_constraints=[("T1", ["tensor(float)"], ""), ("T2", ["tensor(uint8)", "tensor(int8)"], "")],
                    attributes=ints)


def low_bit_layouts(model) -> dict[str, tuple[str, str]]:
    """Point the low-bit kernels at their weights' layouts: MatMulNBits' 4-bit values offset by 8
    (its default zero point), two to a byte, low nibble first, and its scales flat; MatMulInteger's
    int8 values as (in, out), all made from passes.quantize's int8 [out, groups, group] values,
    which the translation names. The recipe: each new weight's name → (layout, the weight it is
    made from), for `laid_out` (at compile and at load: a bundle or the disk cache keeps the
    graph's weights only)."""
    recipe: dict[str, tuple[str, str]] = {}
    for node in model.graph.node:
        if node.op_type == "MatMulNBits" and node.domain == "com.microsoft":
            for i, layout in ((1, "nibbles"), (2, "flat")):
                recipe[f"{node.input[i]}_{layout}"] = (layout, node.input[i])
                node.input[i] = f"{node.input[i]}_{layout}"
        elif node.op_type == "MatMulInteger":
            recipe[f"{node.input[1]}_in_out"] = ("in_out", node.input[1])
            node.input[1] = f"{node.input[1]}_in_out"
    return recipe


def laid_out(recipe: dict[str, tuple[str, str]], constants: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    made = {}
    for name, (layout, source) in recipe.items():
        q = constants[source]
        if layout == "nibbles":
            nibbles = (q.to(torch.int16) + 8).to(torch.uint8).reshape(*q.shape[:2], -1, 2)
            made[name] = nibbles[..., 0] | (nibbles[..., 1] << 4)
        elif layout == "flat":
            made[name] = q.reshape(-1).contiguous()
        else:
            made[name] = q.reshape(q.shape[0], -1).t().contiguous()
    return made


# kept whole though torch's decomposition of it is wrong, not just rounded differently (it counts
# the target slots past a row's -1 end marker): the exporter's would be too
_WRONG_DECOMPOSITIONS = frozenset({torch.ops.aten.multilabel_margin_loss_forward.default})


def prepare() -> None:
    """What every export in this process needs once: torchlib imported, its registry made and our
    translations defined (~0.7 s, mostly imports)."""
    from torch.onnx._constants import ONNX_DEFAULT_OPSET

    _torchlib(ONNX_DEFAULT_OPSET)
    _translations()


def translated(op: torch._ops.OpOverload) -> bool:
    """Does the export translate op? torchlib's or our translation; or, for an op the door keeps
    whole that torchlib lacks (recording.ops.KEPT_WHOLE), the exporter's own decomposition of it
    with torch's table: the ops the door would otherwise have recorded."""
    from torch.onnx._constants import ONNX_DEFAULT_OPSET

    return _torchlib(ONNX_DEFAULT_OPSET).is_registered(op) or op in _translations() or op in BATCH_NORM_TRAINING or \
        (op in KEPT_WHOLE and op not in _WRONG_DECOMPOSITIONS)


def to_onnx(graph: CapturedGraph, ranges: dict | None = None, weights_apart: bool = False):
    """The graph as an ONNX ModelProto (torchlib's translation of its ExportedProgram); its
    constants are initializers named like their placeholders. Opset 23 where a composite needs
    its kernels, else the exporter's default (20): plain graphs ran 1-2 % slower at 23. `ranges`
    gets the ranges of the symbols the export narrowed (torchnative.sizes.exported_ranges).
    `weights_apart`: the graph's weights are initializers without data, external references named
    `<name>.weight`, which the runtime is given by name (serializing GPT-2 small's 474 MB into the
    model only to drop them again took ~0.7 s a program)."""
    nodes = graph.gm.graph.nodes
    composite = any(n.target in _COMPOSITE_OPS for n in nodes)
    needed = {n.target for n in nodes if n.target in _OURS and _OURS[n.target](n)}
    ours = _translations()
    saving = any(n.target in SDPA and saved_read(n) for n in nodes)
    table = tuple((op, ours[_SAVING_ATTENTION] if saving and op in SDPA else fn) for op, fn in ours.items()
                  if op is not _SAVING_ATTENTION and (op in needed or op not in _OURS))
    from torch.onnx._internal.exporter._constants import TORCHLIB_OPSET

    opset = 23 if composite else torch.onnx._constants.ONNX_DEFAULT_OPSET
    registry = _registry(max(opset, TORCHLIB_OPSET), table)
    apart = graph.constants if weights_apart else {}
    decompose = any(n.target in _DECOMPOSED_WHERE and _DECOMPOSED_WHERE[n.target](n) for n in nodes)
    exported = None if decompose else _as_exported(graph, registry)
    if exported is not None:
        with quiet():
            return _export(exported, opset, registry, apart)
    exported = graph.to_exported_program()
    if ranges is not None:
        ranges.update(exported_ranges(exported, graph.gm))
    with quiet():
        if decompose:
            exported = exported.run_decompositions({op: DECOMPOSITIONS.get(op) or decomposition_table[op]
                                                         for op in _DECOMPOSED_WHERE})
        return _export(exported, opset, registry, apart)


def _as_exported(graph: CapturedGraph, registry) -> "torch.export.ExportedProgram | None":
    """The ExportedProgram torch.export makes of the graph, made without tracing it again (0.3-0.7 s
    a partition: half of an ONNX Runtime compile), for a graph the trace would give back as it is:
    sizes fixed, Core ATen ops that are functional, have no composite or Python kernel and are not
    ones the exporter decomposes, and tensors out. Its constants are buffers as there, its values
    fake tensors as there. None for any other graph (torch.export it is)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.export import ExportedProgram
    from torch.export.graph_signature import (ExportGraphSignature, InputKind, InputSpec, OutputKind,
                                              OutputSpec, TensorArgument)

    decomposed = _decomposed(registry)
    outputs = graph.output_node().args[0]
    if is_symbolic(graph.gm) or not all(n.op in ("placeholder", "output") or (n.op == "call_function" and
                                            _kept(n.target, decomposed)) for n in graph.gm.graph.nodes) \
            or not all(isinstance(o, fx.Node) and isinstance(o.meta.get("val"), torch.Tensor) for o in outputs):
        return None
    mode = FakeTensorMode()

    def fake(v):
        if isinstance(v, torch.Tensor):
            return mode.from_tensor(torch.empty_strided(v.shape, v.stride(), dtype=v.dtype))
        return type(v)(map(fake, v)) if isinstance(v, (tuple, list)) else v

    root, g, env, specs = torch.nn.Module(), fx.Graph(), {}, []
    for n in graph.gm.graph.nodes:
        if n.op == "output":
            g.output(tuple(env[o] for o in outputs))
            continue
        env[n] = g.node_copy(n, env.__getitem__)
        env[n].meta = {"val": fake(n.meta.get("val"))}
        if n.op == "placeholder" and n.name in graph.constants:
            root.register_buffer(n.name, graph.constants[n.name].detach())
            specs.append(InputSpec(InputKind.BUFFER, TensorArgument(env[n].name), target=n.name, persistent=True))
        elif n.op == "placeholder":
            specs.append(InputSpec(InputKind.USER_INPUT, TensorArgument(env[n].name), target=None))
    gm = fx.GraphModule(root, g)
    signature = ExportGraphSignature(specs, [OutputSpec(OutputKind.USER_OUTPUT, TensorArgument(env[o].name), target=None)
                                             for o in outputs])
    return ExportedProgram(root=gm, graph=gm.graph, graph_signature=signature, state_dict=dict(root.named_buffers()),
                           range_constraints={}, module_call_graph=[], example_inputs=None, constants={})


def _export(exported, opset: int, registry, apart: dict):
    """What `torch.onnx.export(exported, dynamo=True, optimize=False, opset_version=opset,
    custom_translation_table=...)` returns, with torchlib's registry made once (`_registry`)."""
    import onnx_ir as ir
    from torch.onnx._internal.exporter import _core, _fx_passes
    from torch.onnx._internal.exporter._dynamic_shapes import convert_str_to_export_dim

    shapes, _ = convert_str_to_export_dim({})
    decompose = functools.partial(_decompose_where_needed, _fx_passes.decompose_with_registry)
    with mock.patch.object(_fx_passes, "decompose_with_registry", decompose):
        program = _core.export(exported, registry=registry, dynamic_shapes=shapes,
                               verbose=False, optimize=False, opset_version=opset)
    for name, value in program.model.graph.initializers.items():
        t, data = apart.get(name), value.const_value
        if t is not None and data is not None and t.numel() > 1 and tuple(data.shape) == tuple(t.shape):
            value.const_value = ir.ExternalTensor(f"{name}.weight", None, None, data.dtype, shape=data.shape, name=name)
    return program.model_proto


def _decompose_where_needed(decompose, exported, registry):
    """The exporter's decomposition (torch's decompositions of the ops ONNX has no translation
    for, of composite ops and of ops with Python kernels its retrace runs, like upsample_bilinear2d's
    autograd one; and functionalization), skipped for a program it would leave as it is: our
    graphs are Core ATen and functional already, and its retrace of the whole graph was half a
    partition's compile (~0.3 s)."""
    decomposed = _decomposed(registry)
    if all(n.op != "call_function" or _kept(n.target, decomposed) for n in exported.graph.nodes):
        return exported
    return decompose(exported, registry)


def _kept(target, decomposed: frozenset) -> bool:
    """Does the exporter's decomposition (and torch.export's trace) leave a node of `target` as it is?"""
    if target in _SIZE_ARITHMETIC:
        return True
    return isinstance(target, torch._ops.OpOverload) and not target._schema.is_mutable and \
        target not in decomposed and set(target.py_kernels) <= {torch._C.DispatchKey.Meta} and \
        not torch._C._dispatch_has_kernel_for_dispatch_key(target.name(), "CompositeImplicitAutograd")


_SIZE_ARITHMETIC = frozenset({operator.getitem, operator.add, operator.sub, operator.mul, operator.floordiv,
                              operator.mod, operator.neg})


@functools.lru_cache(maxsize=16)
def _decomposed(registry) -> frozenset:
    """The ops the exporter decomposes with this registry (torch's decompositions of the ops it has
    no translation for)."""
    from torch.onnx._internal.exporter import _decomp

    implemented = set(_decomp.get_onnx_implemented_overloads(registry))
    return frozenset(_decomp.create_onnx_friendly_decomposition_table(implemented))


@functools.lru_cache(maxsize=16)
def _registry(opset: int, table: tuple):
    """torchlib's registry at `opset` with our translations `table` ((op, function) pairs) first,
    as torch.onnx.export builds it; the export only reads it."""
    from torch.onnx._internal.exporter import _registration

    base = _torchlib(opset)
    registry = _registration.ONNXRegistry()
    registry._opset_version = base.opset_version
    registry.functions = {k: list(v) for k, v in base.functions.items()}  # register_op inserts into these lists
    for op, fn in table:
        registry.register_op(op, fn, is_complex=False)
    return registry

"""Our composites (passes.fuse) as Core AI composite ops: a private graph carrying Core AI's
composite declaration (`rms_norm`, `rope`, `gated_delta_update`), which a device's runtime replaces by its fused kernel
and the reference runtime here runs as written. Each body is the composite's arithmetic in its
eager op order (passes.fuse), so what runs here is what eager computes. Attention needs no
lowering of ours: coreai-torch makes `scaled_dot_product_attention` its composite itself.

Declarations follow coreai_torch.composite_ops: RMSNorm's inputs (input, scale) and `eps`;
RoPE's (input, cos, sin) with cos and sin over half the rotated dims, rotate-half layout;
GatedDeltaUpdate's (query, key, value, g, beta, initial_state) → (output, state) over one token,
the query before its 1/√dk scaling (which the composite does), output [b, s, h, dv].

A weight passes.quantize made low-bit (fused as `quantized_mm`) becomes Core AI's compressed
weight: its integers a constant of their width (int8, or int4 packed two to a byte), dequantized by
`blockwise_shift_scale` with the scales per output channel or group: what a device keeps
compressed and expands in its kernel. A palettized weight (quantize="palettize4") becomes Core AI's
`lut_to_dense` of its 4-bit indices and per-channel table. The float weight is never in the asset."""
# no `from __future__ import annotations`: Core AI's graph builder reads the bodies' hints as types
import functools
from typing import Any

import numpy as np
import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph
from torchnative.passes.derived import add_constant


_WHOLE_DIM = 2 ** 31 - 1  # a slice's end that takes the whole dim (coreai-torch's own for aten.slice)


def register(converter: Any) -> None:
    """Teach a coreai_torch.TorchConverter our composites."""
    converter.register_torch_lowering("torchnative::rms_norm.default")(_rms_norm)
    converter.register_torch_lowering("torchnative::rope.default")(_rope)
    converter.register_torch_lowering("torchnative::delta_rule.default")(_delta_rule)
    converter.register_torch_lowering("torchnative::quantized_mm.default")(
        functools.partial(_quantized_mm, converter))


def palettized(graph: CapturedGraph) -> CapturedGraph:
    """A copy whose palettized weights (passes.quantize: a constant whose meta holds its indices and
    table) are `coreai::lut_to_dense` of two constants, the indices uint8 (the converter narrows them
    to the table's 4 bits) and the table [out, 1, 2**bits, 1]: one table per output channel."""
    if not any("palette" in p.meta for p in graph.placeholders()):
        return graph
    from coreai_torch._compression.custom_layers import lut_to_dense  # noqa: F401 -- registers coreai::lut_to_dense

    graph = graph.copy()
    g, constants = graph.gm.graph, dict(graph.constants)
    for p in (p for p in graph.placeholders() if "palette" in p.meta):
        indices, table = p.meta["palette"]
        table = table.reshape(table.shape[0], 1, table.shape[1], 1)
        made = []
        for suffix, value in (("indices", indices), ("lut", table)):  # the converter finds them by these names
            c = add_constant(graph, p, f"{p.name}_{suffix}")
            c.meta = {"val": value.to("meta"), "role": "constant"}
            constants[c.name] = value
            made.append(c)
        with g.inserting_after(made[-1]):
            dense = g.call_function(torch.ops.coreai.lut_to_dense.default, (*made, 0))
        dense.meta = {k: v for k, v in p.meta.items() if k != "palette"}
        p.replace_all_uses_with(dense)
        graph.input_roles.pop(graph.placeholders().index(p))
        constants.pop(p.name, None)
        g.erase_node(p)
    graph.constants = constants
    graph.gm.recompile()
    return graph


def _constants(exported: torch.export.ExportedProgram) -> dict[str, torch.Tensor]:
    """The exported program's weights by placeholder name."""
    from torch.export.graph_signature import InputKind

    found = {}
    for spec in exported.graph_signature.input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            found[spec.arg.name] = exported.state_dict.get(spec.target, exported.constants.get(spec.target))
    return found


def _quantized_mm(converter: Any, values: dict, node: fx.Node, loc: Any):
    from coreai._compiler.dialects import coreai
    from coreai_torch._compression._intx import IntxTensor

    x, q, scale, bias, bits = node.args
    if bits == 4:
        # the program being converted (a converter converts its programs one at a time)
        weights = _constants(converter.exported_program)
        integers = converter._constant_from_tensor(IntxTensor.from_unpacked(weights[q.name], 4))
    else:
        integers = values[q.name]
    scales = values[scale.name]
    n, groups, group = q.meta["val"].shape
    zero_q = coreai.constant(torch.zeros(n, groups, 1, dtype=torch.int8).numpy(), dtype=integers.type.element_type)
    zero_f = coreai.constant(torch.zeros(n, groups, 1).numpy())
    weight = coreai.blockwise_shift_scale(integers, scales, zero_q, zero_f, loc=loc)  # q · scale, [out, groups, group]
    weight = coreai.reshape(weight, [n, groups * group])
    out = coreai.broadcasting_batch_matmul(values[x.name], coreai.transpose(weight, coreai.constant(np.array([1, 0], dtype=np.uint32))))
    return out if bias is None else coreai.broadcasting_add(out, values[bias.name])


def _rms_norm(values: dict, node: fx.Node, loc: Any):
    from coreai._compiler.dialects import coreai
    from coreai._compiler.ir import Value
    from coreai_torch import generate_composite_decl

    x, scale = (values[a.name] for a in node.args[:2])
    eps, last = float(node.args[2]), x.type.rank - 1
    decl = generate_composite_decl(x.context, "rms_norm", ["input", "scale"], ["output"], {"eps": eps})

    @coreai.graph(private=True, no_inline=True, composite_decl=decl)
    def rms_norm(x: Value, scale: Value) -> Value:  # weight · (x · rsqrt(mean(x²) + eps))
        mean = coreai.reduce_mean(coreai.broadcasting_mul(x, x), [last])
        inverse = coreai.rsqrt(coreai.broadcasting_add(mean, coreai.constant(eps, dtype=mean.type.element_type)))
        return coreai.broadcasting_mul(scale, coreai.broadcasting_mul(x, inverse))

    return rms_norm(x, scale)[0]


def _rope(values: dict, node: fx.Node, loc: Any):
    from coreai._compiler.dialects import coreai
    from coreai._compiler.ir import Value
    from coreai_torch import generate_composite_decl

    x, cos, sin = (values[a.name] for a in node.args)
    shape, half = list(x.type.shape), x.type.shape[-1] // 2

    def halves(v, rank: int):  # v[..., :half] and v[..., half:] of a rank-`rank` tensor
        lead = [_WHOLE_DIM] * (rank - 1)  # to the end, whatever its size: a dim that varies has none here
        first = coreai.slice_(v, [0] * rank, [*lead, half], [1] * rank)
        return first, coreai.slice_(v, [0] * (rank - 1) + [half], [*lead, 2 * half], [1] * rank)

    # fuse proved that cos and sin repeat their first half: the composite takes that half
    cos, sin = halves(cos, cos.type.rank)[0], halves(sin, sin.type.rank)[0]
    decl = generate_composite_decl(x.context, "rope", ["input", "cos", "sin"], ["output"], {"interleaved": False})

    @coreai.graph(private=True, no_inline=True, composite_decl=decl)
    def rope(x: Value, cos: Value, sin: Value) -> Value:  # [x₁·cos − x₂·sin, x₂·cos + x₁·sin]: eager's x·cos + [−x₂, x₁]·sin, exactly
        x1, x2 = halves(x, len(shape))
        first = coreai.broadcasting_sub(coreai.broadcasting_mul(x1, cos), coreai.broadcasting_mul(x2, sin))
        second = coreai.broadcasting_add(coreai.broadcasting_mul(x2, cos), coreai.broadcasting_mul(x1, sin))
        return coreai.concat(len(shape) - 1, [first, second])

    return rope(x, cos, sin)[0]


def _delta_rule(values: dict, node: fx.Node, loc: Any):
    from coreai._compiler.dialects import coreai
    from coreai._compiler.ir import Value
    from coreai_torch import generate_composite_decl

    state, q, k, v, g, beta = (values[a.name] for a in node.args[:6])
    index, scale = node.args[6:]
    if not state.type.has_static_shape:  # the body's reshapes name its sizes: refused, not a wrong program
        raise NotImplementedError(f"a gated delta rule whose state's sizes vary ({node.args[0].meta['val'].shape}): "
                                  "Core AI's composite is built for a fixed state")
    b, h, dk, dv = state.type.shape

    def token(x):  # token `index` of a sequence [b, h, s, ...], the sequence dim kept
        rank = x.type.rank
        return coreai.slice_(x, [0, 0, index] + [0] * (rank - 3), [_WHOLE_DIM] * 2 + [index + 1] + [_WHOLE_DIM] * (rank - 3),
                             [1] * rank)

    def perm(*axes):
        return coreai.constant(np.array(axes, dtype=np.uint32))

    decl = generate_composite_decl(state.context, "gated_delta_update", ["query", "key", "value", "g", "beta", "initial_state"],
                                   ["output", "state"], {"use_qk_l2_norm": False})

    @coreai.graph(private=True, no_inline=True, composite_decl=decl)
    def gated_delta_update(query: Value, key: Value, value: Value, g: Value, beta: Value, state: Value) -> tuple[Value, Value]:
        # fuse's delta_rule op for op: S·exp(g); S + k ⊗ β(v − Sᵀk); Sᵀ(q / scale)
        s = coreai.broadcasting_mul(state, coreai.reshape(coreai.exp(g), [b, h, 1, 1]))
        ku = coreai.reshape(key, [b, h, dk, 1])
        remembered = coreai.reshape(coreai.reduce_sum(coreai.broadcasting_mul(s, ku), [2]), [b, h, 1, dv])
        delta = coreai.broadcasting_mul(coreai.broadcasting_sub(coreai.reshape(value, [b, h, 1, dv]), remembered),
                                        coreai.reshape(beta, [b, h, 1, 1]))
        s = coreai.broadcasting_add(s, coreai.broadcasting_mul(ku, delta))
        qu = coreai.broadcasting_divide(coreai.reshape(query, [b, h, dk, 1]),
                                        coreai.constant(scale, dtype=query.type.element_type))
        out = coreai.reshape(coreai.reduce_sum(coreai.broadcasting_mul(s, qu), [2]), [b, h, 1, dv])
        return coreai.transpose(out, perm(0, 2, 1, 3)), s

    output, new_state = gated_delta_update(token(q), token(k), token(v), token(g), token(beta), state)
    return [coreai.reshape(coreai.transpose(output, perm(0, 2, 1, 3)), [b, h, dv]), new_state]

"""Our composites (passes.fuse) as Core AI composite ops: a private graph carrying Core AI's
composite declaration (`rms_norm`, `rope`), which a device's runtime replaces by its fused kernel
and the reference runtime here runs as written. Each body is the composite's arithmetic in its
eager op order (passes.fuse), so what runs here is what eager computes. Attention needs no
lowering of ours: coreai-torch makes `scaled_dot_product_attention` its composite itself.

Declarations follow coreai_torch.composite_ops: RMSNorm's inputs (input, scale) and `eps`;
RoPE's (input, cos, sin) with cos and sin over half the rotated dims, rotate-half layout."""
# no `from __future__ import annotations`: Core AI's graph builder reads the bodies' hints as types
from typing import Any

import torch.fx as fx


def register(converter: Any) -> None:
    """Teach a coreai_torch.TorchConverter our composites."""
    converter.register_torch_lowering("torchnative::rms_norm.default")(_rms_norm)
    converter.register_torch_lowering("torchnative::rope.default")(_rope)


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
        lead = list(v.type.shape[:-1])
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

"""Weight quantization: float weights that feed a matmul or convolution (through views) become
int8 values plus float scales, dequantized in the graph — int8 per output channel, or int4 in
groups of 32 along the input dimension (held in int8). Only `param` inputs; `pinned` and `state` tensors are never quantized.

`dequantized(w, scheme)` is the float weight the graph computes, for references and accuracy
checks. The candle k-quants (q8_0, q4k) are the `candle-q8_0`/`candle-q4k` delegates' own."""
from __future__ import annotations

import weakref

import torch
import torch.fx as fx

from torchnative import events
from torchnative.ir import CapturedGraph
from torchnative.passes.derived import Derived, add_constant, placeholders

aten = torch.ops.aten
SCHEMES = {"int8": (127, None), "int4": (7, 32)}  # (largest level, group size or per channel)
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default}
_VIEWS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
          aten.expand.default, aten.unsqueeze.default, aten.reshape.default}
_cache: dict = {}  # (id, version, scheme) -> (weakref to the weight, q, scale)


def _feeds_matmul(n: fx.Node) -> bool:
    return any(u.target in _MATMULS or (u.target in _VIEWS and _feeds_matmul(u)) for u in n.users)


def _grouped(w: torch.Tensor, group: int | None) -> torch.Tensor:
    rows = w.reshape(w.shape[0], -1)
    return rows.unsqueeze(1) if group is None else rows.reshape(w.shape[0], -1, group)


def quantize_tensor(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, groups, group], scale float [out, groups, 1]) with w ≈ q * scale."""
    top, group = SCHEMES[scheme]
    g = _grouped(w.detach().float(), group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    return (g / scale).round().clamp(-top - 1, top).to(torch.int8), scale


def dequantized(w: torch.Tensor, scheme: str) -> torch.Tensor:
    """The weight as the quantized graph computes it."""
    q, scale = quantize_tensor(w, scheme)
    return (q.to(torch.float32) * scale).reshape(w.shape).to(w.dtype)


def why_not(w: torch.Tensor, scheme: str) -> str:
    """Why this weight stays as it is ('' when it is quantized)."""
    if not w.dtype.is_floating_point:
        return f"dtype {w.dtype} is not floating point"
    if not w.is_contiguous():
        return "not contiguous"
    _, group = SCHEMES[scheme]
    if group is not None and (w[0].numel() if w.dim() else 0) % group:
        return f"{w[0].numel()} values per output channel is not a multiple of the group size {group}"
    return ""


def _cached(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    key = (id(w), w._version, scheme)
    hit = _cache.get(key)
    if hit is None or hit[0]() is not w:  # a weakref: the cache must not keep old weights alive
        hit = _cache[key] = (weakref.ref(w), *quantize_tensor(w, scheme))
    return hit[1], hit[2]


def quantize_weights(graph: CapturedGraph, inputs: list[torch.Tensor], scheme: str, derived: Derived) -> CapturedGraph:
    if scheme not in SCHEMES:
        raise ValueError(f"quantize={scheme!r} is not a weight quantization scheme; choose one of {sorted(SCHEMES)}")
    g = graph.gm.graph
    for i, (p, role, w) in enumerate(zip(placeholders(graph), list(graph.input_roles), inputs)):
        if role != "param" or w.dim() < 2 or not _feeds_matmul(p):
            continue
        reason = why_not(w, scheme)
        events.STATS.quantized[f"{scheme}: {reason or 'quantized'}"] += 1
        if reason:
            continue
        q, scale = _cached(w, scheme)
        qp, sp = add_constant(graph, p, f"{p.name}_q"), add_constant(graph, p, f"{p.name}_scale")
        qp.meta["val"], sp.meta["val"] = q.to("meta"), scale.to("meta")
        derived.tensors += [q, scale]
        derived.sources.add(i)
        with g.inserting_after(sp):
            f = g.call_function(aten._to_copy.default, (qp,), {"dtype": torch.float32})
        with g.inserting_after(f):
            m = g.call_function(aten.mul.Tensor, (f, sp))
        with g.inserting_after(m):
            deq = g.call_function(aten.view.default, (m, list(w.shape)))
        f.meta["val"] = q.to("meta").to(torch.float32)
        m.meta["val"] = f.meta["val"] * sp.meta["val"]
        deq.meta["val"] = m.meta["val"].view(w.shape)
        for x in (f, m, deq):
            x.meta["stack"] = p.meta.get("stack") or ("<quantize>", 0)
        p.replace_all_uses_with(deq)
    graph.gm.recompile()
    return graph

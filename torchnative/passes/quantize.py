"""Weight quantization: float weights that feed a matmul or convolution (through views) become
int8 values plus float scales, dequantized in the graph — int8 per output channel, or int4 in
groups of 32 along the input dimension (held in int8). Only `param` inputs; `pinned` and `state` tensors are never quantized.
A 2-D weight that a matmul reads as it is, (in, out) (transformers' Conv1D), is quantized as its
transpose, so that the groups run along the input dimension as for nn.Linear's (out, in): the
dequantized values then reach every matmul as `permute(view(q · scale, (out, in)), [1, 0])`, the form that
passes.fuse's quantized_mm matches (a delegate with low-bit kernels runs it as one). The
quantized constant's placeholder names its scheme in `meta["quantized"]`.

Palettization (palettize4): each output channel's values replaced by the nearest of 16 (a table found
by k-means over that channel), as Apple's compressed weights are: a matmul's weight becomes a
constant holding the table's values (what eager and every delegate compute with), whose placeholder
carries the 4-bit indices and the table (`meta["palette"]`), which `coreai` keeps as its program's
weight (a lookup expanded on device).

GGUF k-quants (q8_0, q4k), whose kernels are candle's: a matmul's 2-D weight operand, quantized
in blocks along its input dimension by candle, becomes a constant holding the dequantized values
(what eager and every other delegate compute with) whose placeholder carries the candle QTensor
(`meta["kquant"]`), which the candle delegate runs with its k-quant matmul.

`dequantized(w, scheme, in_out)` is the float weight the graph computes, for references and accuracy
checks (for k-quants, of an (out, in) weight as nn.Linear holds it; `in_out`: a weight read as (in,
out), as above)."""
from __future__ import annotations

import os
import tempfile
import weakref
from typing import Any

import torch
import torch.fx as fx

from torchnative import events
from torchnative.grad import version
from torchnative.ir import CapturedGraph
from torchnative.lru import Lru
from torchnative.passes.derived import Derived, add_constant

aten = torch.ops.aten
SCHEMES = {"int8": (127, None), "int4": (7, 32)}  # (largest level, group size or per channel)
KQUANTS = {"q8_0": 32, "q4k": 256}  # GGUF block size along the input dimension
PALETTES = {"palettize4": 4}  # bits of an index into each output channel's table of values
ALL_SCHEMES = sorted(SCHEMES | KQUANTS | PALETTES)
_MATMULS = {aten.mm.default, aten.addmm.default, aten.bmm.default, aten.convolution.default}
_MAT2 = {aten.mm.default: 1, aten.addmm.default: 2}  # where the weight operand is, (in, out)
_VIEWS = {aten.t.default, aten.permute.default, aten.transpose.int, aten.view.default, aten._unsafe_view.default,
          aten.expand.default, aten.unsqueeze.default, aten.reshape.default}
# (id, version, scheme[, operand layout]) -> (weakref to the weight, quantized values); each entry
# is a copy of a weight: bounded
_cache = Lru(1024, "quantized weights")


def _on_path_to_matmul(u: fx.Node) -> bool:
    return u.target in _MATMULS or (u.target in _VIEWS and _feeds_matmul(u))


def _feeds_matmul(n: fx.Node) -> bool:
    return any(_on_path_to_matmul(u) for u in n.users)


def _grouped(w: torch.Tensor, group: int | None) -> torch.Tensor:
    rows = w.reshape(w.shape[0], -1)
    return rows.unsqueeze(1) if group is None else rows.reshape(w.shape[0], -1, group)


def quantize_tensor(w: torch.Tensor, scheme: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, groups, group], scale float [out, groups, 1]) with w ≈ q * scale; for a
    palette, (indices uint8 [out, values per channel], table float [out, 2**bits])."""
    if scheme in PALETTES:
        return palettize_tensor(w, PALETTES[scheme])
    top, group = SCHEMES[scheme]
    g = _grouped(w.detach().float(), group)
    scale = g.abs().amax(-1, keepdim=True).clamp_min(torch.finfo(torch.float32).tiny) / top
    return (g / scale).round().clamp(-top - 1, top).to(torch.int8), scale


def palettize_tensor(w: torch.Tensor, bits: int, rounds: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    """Per output channel, 2**bits values found by k-means (Lloyd's rounds from the channel's
    quantiles; 16 rounds: within ~10 % of the optimum's error on Gaussian weights) and each value's nearest: (indices uint8 [out, n], table float [out, 2**bits],
    sorted)."""
    rows = w.detach().float().reshape(w.shape[0], -1)
    k, n = 2 ** bits, rows.shape[1]
    table = rows.sort(dim=1).values[:, ((torch.arange(k) + 0.5) * n / k).long().clamp_max(n - 1)]
    nearest = _nearest(table, rows)
    for _ in range(rounds):
        sums = torch.zeros_like(table).scatter_add_(1, nearest, rows)
        counts = torch.zeros_like(table).scatter_add_(1, nearest, torch.ones_like(rows))
        table = torch.where(counts > 0, sums / counts.clamp_min(1), table).sort(dim=1).values  # an unused value stays
        nearest = _nearest(table, rows)
    return nearest.to(torch.uint8), table


def _nearest(table: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
    """Per row, the index of the nearest of its table's sorted values (ties to the lower)."""
    return torch.searchsorted(((table[:, 1:] + table[:, :-1]) / 2).contiguous(), rows)


def expanded(q: torch.Tensor, scale: torch.Tensor, scheme: str, shape: list[int]) -> torch.Tensor:
    """The float weight of quantize_tensor's pair, in `shape`."""
    if scheme in PALETTES:
        return scale.gather(1, q.long()).view(shape)
    return (q.to(torch.float32) * scale).view(shape)


def dequantized(w: torch.Tensor, scheme: str, in_out: bool = False) -> torch.Tensor:
    """The weight as the quantized graph computes it; `in_out`: a 2-D weight that matmuls read as
    it is, (in, out) (transformers' Conv1D), quantized along its first dimension."""
    if in_out:
        return dequantized(w.t().contiguous(), scheme).t()
    if scheme in KQUANTS:
        return kquantized(w, scheme)[1].to(w.dtype)
    return expanded(*quantize_tensor(w, scheme), scheme, list(w.shape)).to(w.dtype)


def low_bit_activations(x: torch.Tensor, scheme: str) -> torch.Tensor:
    """The values ONNX Runtime's low-bit kernel for `scheme` multiplies a matmul's activations
    `x` as: int8's MatMulInteger takes them quantized per tensor (DynamicQuantizeLinear: uint8,
    its zero point and scale from the tensor's range), int4's MatMulNBits at accuracy level 4 in
    blocks of 32 along the reduced dimension (int8, symmetric, scale max|x|/127). Rounding half to
    even, as both do."""
    if scheme == "int8":
        low, high = min(x.min().item(), 0.0), max(x.max().item(), 0.0)
        scale = (high - low) / 255 or 1.0
        zero = min(max(round(-low / scale), 0), 255)
        return (torch.clamp(torch.round(x / scale) + zero, 0, 255) - zero) * scale
    group = SCHEMES[scheme][1]
    blocks = x.reshape(*x.shape[:-1], x.shape[-1] // group, group)
    scale = blocks.abs().amax(-1, keepdim=True) / 127
    return (torch.round(blocks / torch.where(scale == 0, 1.0, scale)) * scale).reshape(x.shape)


def dequantized_copy(model: torch.nn.Module, scheme: str, activations: bool = False) -> torch.nn.Module:
    """A copy of `model` whose linear layers' weights are the values the quantized graphs compute
    with (eager's reference for `quantize=scheme`): nn.Linear's (out, in), transformers' Conv1D's
    (in, out), each a Parameter of its own, so an embedding tied to the LM head stays float as in
    the graphs (only matmuls read dequantized values). `activations`: the layers' inputs too are
    the values `ort`'s low-bit kernels compute with (low_bit_activations)."""
    import copy

    from transformers.pytorch_utils import Conv1D

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, (torch.nn.Linear, Conv1D)):
                m.weight = torch.nn.Parameter(dequantized(m.weight, scheme, in_out=isinstance(m, Conv1D)))
                if activations:
                    m.register_forward_pre_hook(lambda _, args: (low_bit_activations(args[0], scheme), *args[1:]))
    return ref


def kquantized(w: torch.Tensor, scheme: str) -> tuple[Any, torch.Tensor]:
    """(candle QTensor, its dequantized values) of an (out, in) float matrix, blocks along `in`.
    candle's bindings move tensors through files (their element-wise conversions take seconds)."""
    try:
        import candle
    except ImportError as e:
        raise RuntimeError(f"quantize={scheme!r}: GGUF k-quants are made and run by candle, which is not "
                           f"installed (pip install candle-nn==0.4.2)") from e
    import safetensors.torch

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "w.safetensors")
        safetensors.torch.save_file({"w": w.detach().float().contiguous()}, path)
        q = candle.utils.load_safetensors(path)["w"].quantize(scheme)
        candle.utils.save_safetensors(path, {"w": q.dequantize()})
        return q, safetensors.torch.load_file(path)["w"]


def why_not(w: torch.Tensor, scheme: str) -> str:
    """Why this weight stays as it is ('' when it is quantized)."""
    if not w.dtype.is_floating_point:
        return f"dtype {w.dtype} is not floating point"
    if scheme in KQUANTS:
        if w.dim() != 2 or w.shape[0] % KQUANTS[scheme]:
            return f"a matmul weight of shape {list(w.shape)}: {scheme} needs 2-D, input dimension a multiple of {KQUANTS[scheme]}"
        return ""
    if not w.is_contiguous():
        return "not contiguous"
    if scheme in PALETTES:
        return ""
    _, group = SCHEMES[scheme]
    if group is not None and (w[0].numel() if w.dim() else 0) % group:
        return f"{w[0].numel()} values per output channel is not a multiple of the group size {group}"
    return ""


def _cached(w: torch.Tensor, scheme: str, in_out: bool) -> tuple[torch.Tensor, torch.Tensor]:
    key = (id(w), version(w), scheme, in_out)
    hit = _cache.get(key)
    if hit is None or hit[0]() is not w:  # a weakref: the cache must not keep old weights alive
        hit = _cache[key] = (weakref.ref(w), *quantize_tensor(w.detach().t().contiguous() if in_out else w, scheme))
    return hit[1], hit[2]


def _read_as_in_out(p: fx.Node) -> bool:
    """Is this 2-D weight read only as a matmul's second operand, as it is (transformers' Conv1D)?"""
    return p.meta["val"].dim() == 2 and all(u.target in _MAT2 and u.args.index(p) == _MAT2[u.target] and
                                            u.args.count(p) == 1 for u in p.users)


def _matmul_weights(graph: CapturedGraph) -> list[tuple[fx.Node, list[fx.Node], int]]:
    """(mm/addmm node, views from a `param` placeholder to its weight operand, placeholder index)."""
    index = {p: i for i, p in enumerate(graph.placeholders())}
    found = []
    for n in graph.gm.graph.nodes:
        if n.target not in _MAT2:
            continue
        chain, v = [], n.args[_MAT2[n.target]]
        while isinstance(v, fx.Node) and v.target in _VIEWS:
            chain.append(v)
            v = v.args[0]
        if v in index and graph.input_roles[index[v]] == "param":
            found.append((n, chain[::-1], index[v]))
    return found


def _kquantize_weights(graph: CapturedGraph, inputs: list[torch.Tensor], scheme: str, derived: Derived) -> CapturedGraph:
    """Each matmul's weight operand (the param through its views, as the matmul reads it: (in, out))
    becomes a constant of its k-quant's dequantized values, the QTensor in its meta."""
    g = graph.gm.graph
    for mm, chain, i in _matmul_weights(graph):
        value = inputs[i].detach()
        for v in chain:
            value = v.target(value, *v.args[1:], **v.kwargs)
        reason = why_not(value, scheme)
        events.STATS.quantized[f"{scheme}: {reason or 'quantized'}"] += 1
        if reason:
            continue
        q, values = _kcached(inputs[i], value, scheme)
        operand = mm.args[_MAT2[mm.target]]
        c = add_constant(graph, operand, f"{operand.name}_{scheme}")
        c.meta["val"], c.meta["kquant"] = values.to("meta"), q
        derived.tensors.append(values)
        derived.sources.add(i)
        mm.replace_input_with(operand, c)
        for v in reversed(chain):  # the views the weight reached the matmul through, if nothing else reads them
            if not v.users:
                g.erase_node(v)
    graph.gm.recompile()
    return graph


def _kcached(w: torch.Tensor, operand: torch.Tensor, scheme: str) -> tuple[Any, torch.Tensor]:
    """The k-quant of a weight operand (in, out), its values back in that layout, kept per weight
    version like the int schemes' (a weight read by several programs is quantized once)."""
    key = (id(w), version(w), scheme, tuple(operand.shape), operand.stride())
    hit = _cache.get(key)
    if hit is None or hit[0]() is not w:
        q, values = kquantized(operand.t(), scheme)
        hit = _cache[key] = (weakref.ref(w), q, values.t())
    return hit[1], hit[2]


def _cached_values(w: torch.Tensor, scheme: str, in_out: bool, shape: list[int]) -> torch.Tensor:
    """The dequantized values, as the graph's ops compute them from q and scale, kept per weight version."""
    key = (id(w), version(w), scheme, in_out, "values")
    hit = _cache.get(key)
    if hit is None or hit[0]() is not w:
        q, scale = _cached(w, scheme, in_out)
        _forget_dead()
        hit = _cache[key] = (weakref.ref(w), expanded(q, scale, scheme, shape))
    return hit[1]


def _forget_dead() -> None:
    """Drop what the cache holds for weights no longer alive (float values are a weight's size)."""
    for k in [k for k, hit in _cache.items() if hit[0]() is None]:
        _cache.pop(k)


def quantize_weights(graph: CapturedGraph, inputs: list[torch.Tensor], scheme: str, derived: Derived,
                     once: bool = False) -> CapturedGraph:
    """`once`: the program runs on eager alone (a graph not compiled yet, or whose sizes vary): the
    dequantized values are computed once per weight version and read as constants, not computed
    from q and scale at every call (GPT-2 small's decode steps over a growing cache ran 2x slower
    than eager's). Delegates with low-bit kernels get q and scale. A palette's values are always
    such a constant: the delegate that keeps them as indices and a table finds both in its meta."""
    if scheme in KQUANTS:
        return _kquantize_weights(graph, inputs, scheme, derived)
    if scheme not in SCHEMES and scheme not in PALETTES:
        raise ValueError(f"quantize={scheme!r} is not a weight quantization scheme; choose one of {ALL_SCHEMES}")
    g = graph.gm.graph
    for i, (p, role, w) in enumerate(zip(graph.placeholders(), list(graph.input_roles), inputs)):
        if role != "param" or w.dim() < 2 or not _feeds_matmul(p):
            continue
        reason = why_not(w, scheme)
        events.STATS.quantized[f"{scheme}: {reason or 'quantized'}"] += 1
        if reason:
            continue
        in_out = _read_as_in_out(p)
        derived.sources.add(i)
        shape = list(w.shape[::-1]) if in_out else list(w.shape)
        if once or scheme in PALETTES:
            deq = add_constant(graph, p, f"{p.name}_dequantized" if scheme in SCHEMES else f"{p.name}_{scheme}")
            value = _cached_values(w, scheme, in_out, shape)
            deq.meta["val"] = value.to("meta")
            if scheme in PALETTES:
                deq.meta["palette"] = _cached(w, scheme, in_out)
            derived.tensors.append(value)
            if in_out:
                with g.inserting_before(deq.next):
                    deq = g.call_function(aten.permute.default, (deq, [1, 0]))
                deq.meta["val"] = value.to("meta").t()
            p.replace_all_uses_with(deq, delete_user_cb=_on_path_to_matmul)
            continue
        q, scale = _cached(w, scheme, in_out)
        qp, sp = add_constant(graph, p, f"{p.name}_q"), add_constant(graph, p, f"{p.name}_scale")
        qp.meta["val"], sp.meta["val"] = q.to("meta"), scale.to("meta")
        qp.meta["quantized"] = scheme
        derived.tensors += [q, scale]
        with g.inserting_before(sp.next):  # in this order, after the placeholders
            f = g.call_function(aten._to_copy.default, (qp,), {"dtype": torch.float32})
            m = g.call_function(aten.mul.Tensor, (f, sp))
            deq = g.call_function(aten.view.default, (m, shape))
            made = [f, m, deq]
            if in_out:
                deq = g.call_function(aten.permute.default, (deq, [1, 0]))
                made.append(deq)
        f.meta["val"] = q.to("meta").to(torch.float32)
        m.meta["val"] = f.meta["val"] * sp.meta["val"]
        made[2].meta["val"] = m.meta["val"].view(shape)
        if in_out:
            deq.meta["val"] = made[2].meta["val"].t()
        for x in made:
            x.meta["stack"] = p.meta.get("stack") or ("<quantize>", 0)
        # only where a matmul reads it: an embedding whose table is tied to the LM head reads the
        # float table, whether or not a cut put the head in another graph
        p.replace_all_uses_with(deq, delete_user_cb=_on_path_to_matmul)
    graph.gm.recompile()
    return graph

"""Attention for delegates that compile it as one op of theirs: masked rows made explicit, and
CPU flash attention as the `scaled_dot_product_attention` their importers know.

Eager's CPU attention kernel gives 0 for a query the mask hides from every key (a left-padded
batch's padded positions; an encoder's padding seen by cross-attention); a softmax over a row of
-inf gives NaN, which then spreads through the rest of the model. ort and candle translate the
rule themselves; IREE, Core ML and Core AI compile attention as one op of theirs, so their graphs
get it written out after each masked attention."""
from __future__ import annotations

import operator

import torch
import torch.fx as fx

aten = torch.ops.aten
FLASH = aten._scaled_dot_product_flash_attention_for_cpu.default


def zero_masked_rows(graph: fx.Graph) -> fx.Graph:
    """Each masked attention's output, 0 where its mask lets a query see no key (in place)."""
    for n in list(graph.nodes):
        mask = n.kwargs.get("attn_mask") if n.target is FLASH else None
        out = next((u for u in n.users if u.target is operator.getitem and u.args[1] == 0), None)
        if mask is None or out is None:
            continue
        users = list(out.users)
        with graph.inserting_before(out.next):  # in order, right after out
            zeroed = _zeroed(graph, out, mask)
        for u in users:
            u.replace_input_with(out, zeroed)
    return graph


def _zeroed(graph: fx.Graph, out: fx.Node, mask: fx.Node) -> fx.Node:
    def add(op, *args):
        node = graph.call_function(op, args)
        node.meta["val"] = op(*(a.meta["val"] if isinstance(a, fx.Node) else a for a in args))
        node.meta["stack"] = out.meta.get("stack")
        return node
    # the mask is float (the kernel takes no other: SDPA's bool masks reach it as 0 and -inf)
    hidden = add(aten.eq.Scalar, add(aten.amax.default, mask, [-1], True), float("-inf"))
    return add(aten.masked_fill.Scalar, out, hidden, 0.0)


def as_sdpa(graph: fx.Graph) -> fx.Graph:
    """Each CPU flash attention whose logsumexp no one reads as `aten.scaled_dot_product_attention`
    (in place): the one attention op compilers that take attention whole (IREE, Core AI) know.
    One whose logsumexp is read (autograd's) is left for the compiler to refuse."""
    for n in list(graph.nodes):
        if n.target is not FLASH:
            continue
        results = {u.args[1]: u for u in n.users}
        if 0 not in results or any(u.users for i, u in results.items() if i != 0):
            continue
        q, k, v, dropout, causal = (*n.args, *(0.0, False)[len(n.args) - 3:])
        grouped = q.meta["val"].shape[-3] != k.meta["val"].shape[-3]  # the CPU kernel groups KV heads unasked
        with graph.inserting_before(n):
            fused = graph.call_function(aten.scaled_dot_product_attention.default, (q, k, v), {
                "attn_mask": n.kwargs.get("attn_mask"), "dropout_p": n.kwargs.get("dropout_p", dropout),
                "is_causal": n.kwargs.get("is_causal", causal), "scale": n.kwargs.get("scale"),
                "enable_gqa": grouped})
        fused.meta = dict(results[0].meta)
        results[0].replace_all_uses_with(fused)
        for u in results.values():
            graph.erase_node(u)
        graph.erase_node(n)
    return graph

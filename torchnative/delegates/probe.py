"""Which kinds of node a backend takes, found by compiling each kind alone: for backends whose
compilers (HTP, Core ML, IREE) say no only when asked to compile. Answers are kept in memory and
in the disk cache, keyed by what the answer depends on (`signature`)."""
from __future__ import annotations

import json
import operator
from typing import Callable

import torch
import torch.fx as fx

from torchnative.delegates.base import in_clean_thread
from torchnative import store
from torchnative.interface import YES, Delegate, Support
from torchnative.ir import CapturedGraph, is_weight, module_of
from torchnative.sizes import SIZES
from torchnative.quiet import quiet
from torchnative.toolchain import fingerprint


def signature(node: fx.Node) -> str:
    """The op, its inputs' ranks and dtypes and which are weights, its other arguments."""
    def arg(a):
        if isinstance(a, fx.Node):
            v = a.meta.get("val")
            if not isinstance(v, torch.Tensor):
                return "?"
            return f"T{v.dim()}{str(v.dtype).removeprefix('torch.')}{'w' if weight(a) is not None else ''}"
        if isinstance(a, (list, tuple)):
            return [arg(x) for x in a]
        return repr(a)
    return json.dumps([str(node.target), [arg(a) for a in node.args], {k: arg(v) for k, v in node.kwargs.items()}])


def weight(a: fx.Node) -> fx.Node | None:
    """The weight placeholder `a` is, or is a view of (a Linear's weight arrives permuted)."""
    while a.op == "call_function" and getattr(a.target, "is_view", False):
        a = a.args[0]
    return a if a.op == "placeholder" and is_weight(a.meta.get("role")) else None


def alone(node: fx.Node) -> CapturedGraph:
    """The node as a graph of its own. What is a weight in its graph is a constant here too, views
    included: a compiler may take a Gemm or a LayerNorm or not by how its weights arrive."""
    g = fx.Graph()
    env, roles, constants = {}, [], {}
    leaves = list(dict.fromkeys(weight(a) or a for a in node.all_input_nodes))
    for a in leaves:
        env[a] = g.placeholder(a.name)
        env[a].meta = {"val": a.meta["val"]}
        role = a.meta.get("role", "input") if a.op == "placeholder" else "input"
        roles.append(role)
        if is_weight(role):
            v = a.meta["val"]
            constants[a.name] = torch.randn(v.shape) if v.dtype.is_floating_point else torch.zeros(v.shape, dtype=v.dtype)

    def copy(a: fx.Node) -> fx.Node:  # a view of a weight: the view too
        if a not in env:
            env[a] = g.node_copy(a, copy)
            env[a].meta = {"val": a.meta["val"]}
        return env[a]

    out = g.node_copy(node, copy)
    # at the sizes it was recorded at: alone, a size its graph computes from others (a view to s0·2)
    # names a symbol that none of its inputs has (the verdict is one per kind of node, any size)
    out.meta = {k: v for k, v in node.meta.items() if k != SIZES}
    if isinstance(node.meta["val"], (tuple, list)):  # the first result: the one models use
        first = g.call_function(operator.getitem, (out, 0))
        first.meta = {"val": node.meta["val"][0]}
        out = first
    g.output([out])
    return CapturedGraph(module_of(g), roles, ["output"], constants)


def _quietly(trial: Callable[[CapturedGraph], None], graph: CapturedGraph) -> None:
    with quiet():  # the compiler's notes on a node it may well refuse
        trial(graph)


def random_inputs(graph: CapturedGraph) -> list[torch.Tensor]:
    """Values for the placeholders passed at run time (not weights)."""
    placeholders = graph.placeholders()
    out = []
    for p, role in zip(placeholders, graph.input_roles):
        if not is_weight(role):
            v = p.meta["val"]
            out.append(torch.randn(v.shape) if v.dtype.is_floating_point else torch.zeros(v.shape, dtype=v.dtype))
    return out


class Probe:
    """`probe(node)`: does `trial` (compile, maybe run) succeed on the node alone? `backend` names
    the compiler in the reason given when it does not."""

    def __init__(self, delegate: Delegate, table: str, backend: str, trial: Callable[[CapturedGraph], None]):
        self.table, self.backend, self.trial = table, backend, trial
        self._fingerprint = lambda: fingerprint(tuple(sorted(delegate.toolchain)))
        self._verdicts: dict[str, Support] = {}

    def __call__(self, node: fx.Node) -> Support:
        key = signature(node)
        if key not in self._verdicts:
            self._verdicts[key] = self._cached(node, key)
        return self._verdicts[key]

    def _cached(self, node: fx.Node, key: str) -> Support:
        table = store.table(self.table, self._fingerprint())
        if key in table:
            ok, reason = table[key]
            return Support(ok, reason)
        verdict = self._try(node)
        store.remember(self.table, self._fingerprint(), key, [verdict.ok, verdict.reason])
        return verdict

    def _try(self, node: fx.Node) -> Support:
        try:
            in_clean_thread(_quietly, self.trial, alone(node))  # asked from inside the door, where export cannot trace
            return YES
        except BaseException as e:  # noqa: BLE001 -- native compilers raise odd things (pyo3 panics)
            if isinstance(e, (KeyboardInterrupt, SystemExit)):
                raise
            lines = str(e).strip().splitlines()
            # a compiler's own diagnosis, not the line saying that the compiler failed
            first = next((x.split("error:", 1)[1].strip() for x in lines if "error:" in x), lines[0] if lines else "")
            first = first[:160] or type(e).__name__
            return Support(False, f"{self.backend} did not take it when compiled alone: {first}")

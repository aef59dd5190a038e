"""The reference executor: a captured graph's own aten ops on real tensors. Takes every node."""
from __future__ import annotations

import operator

from typing import Callable

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from torchnative.interface import YES, Artifact, Availability, Runner, Support
from torchnative.ir import CapturedGraph
from torchnative.sizes import symbolic


class Eager:
    name = "eager"
    external_weights = False
    writes_in_place = True  # it runs the graph as code: index_put_ writes the caller's tensor
    composites: frozenset[str] = frozenset()
    toolchain = ("torch",)
    extension = "pt2"
    calibrates = False
    dynamic = True  # torchnative.sizes.symbolic computes the sizes the graph names from its inputs

    def available(self) -> Availability:
        return Availability("executes")

    def supports(self, node: fx.Node) -> Support:
        return YES

    def compile(self, graph: CapturedGraph) -> Artifact:
        # the artifact is the subgraph itself, in memory (a bundle exports it: bundle/save.py);
        # its Python code is generated once it runs again and again (`Walked`)
        return Artifact(self.name, b"", live=graph)

    def load(self, artifact: Artifact) -> Runner:
        return Walked(symbolic(artifact.live.gm))  # integers that follow a symbol from sizes


# runs a graph's nodes are walked for before its code is generated
_WALKED_RUNS = 2


class Walked:
    """Runs a graph by walking its nodes for its first runs, then by its generated Python code.
    Generating the code of a 500-op graph costs ~30 ms, more than a graph run once or twice takes
    (a decode step at a length no template covers yet, a prompt's prefill at a new length); a walk
    costs a few microseconds an op more than the code, and frees each value after its last use
    as the code does."""
    __slots__ = ("gm", "runs", "forward", "plan")

    def __init__(self, gm: fx.GraphModule):
        self.gm, self.runs = gm, 0
        self.forward = None if _walkable(gm.graph) else _code(gm)
        self.plan: list | None = None

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.forward is None:
            self.runs += 1
            if self.runs <= _WALKED_RUNS:
                return self._walk(inputs)
            self.forward, self.plan = _code(self.gm), None
        return self.forward(*inputs)

    def _walk(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.plan is None:
            self.plan = _plan(self.gm.graph)
        env: dict = {}
        get = env.__getitem__
        given = iter(inputs)
        for n, done in self.plan:
            op = n.op
            if op == "call_function":
                env[n] = n.target(*fx.node.map_arg(n.args, get), **fx.node.map_arg(n.kwargs, get))
            elif op == "placeholder":
                env[n] = next(given)
            elif op == "get_attr":
                env[n] = operator.attrgetter(n.target)(self.gm)
            else:  # output
                return list(fx.node.map_arg(n.args[0], get))
            for d in done:
                del env[d]
        raise AssertionError("a graph without an output node")


def _code(gm: fx.GraphModule) -> Callable:
    """`gm`'s forward as generated code (a lazy module's, generated now: its lazy forward, kept,
    would go through the module's call on every run)."""
    _LazyGraphModule.force_recompile(gm)
    return gm.forward


def _walkable(graph: fx.Graph) -> bool:
    return all(n.op in ("placeholder", "call_function", "get_attr", "output") for n in graph.nodes)


def _plan(graph: fx.Graph) -> list[tuple[fx.Node, list[fx.Node]]]:
    """Each node, with the values whose last use it is (freed after it)."""
    nodes = list(graph.nodes)
    last: dict[fx.Node, int] = {}
    for i, n in enumerate(nodes):
        for a in n.all_input_nodes:
            last[a] = i
    done: list[list[fx.Node]] = [[] for _ in nodes]
    for a, i in last.items():
        if nodes[i].op != "output":
            done[i].append(a)
    return [(n, d) for n, d in zip(nodes, done)]


delegate = Eager()

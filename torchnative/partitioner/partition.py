"""CapturedGraph + delegates → partitions in execution order.

Each call node goes to the first delegate (in the user's preference order) that supports it;
connected nodes of one delegate grow into maximal regions without creating a cycle between
partitions, then unconnected regions of one delegate join where no cycle forbids it; regions with fewer than `min_ops` computing ops (views do not count) go to eager. Every node a delegate declined keeps the reason.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, field
from typing import Sequence

import networkx as nx
import torch.fx as fx

from torchnative.interface import Delegate, Support
from torchnative.passes.scalars import is_scalar
from torchnative.sizes import SIZES

EAGER = "eager"


@dataclass(frozen=True)
class Partition:
    delegate: str
    nodes: tuple[fx.Node, ...]  # in graph order

    @property
    def n_ops(self) -> int:
        return _ops(self.nodes)


@dataclass
class Plan:
    partitions: list[Partition]  # in execution order
    declined: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # node -> [(delegate, reason)]

    def delegate_of(self) -> dict[str, str]:
        return {n.name: p.delegate for p in self.partitions for n in p.nodes}


def partition(graph: fx.Graph, delegates: Sequence[Delegate], min_ops: int = 1) -> Plan:
    nodes = [n for n in graph.nodes if n.op == "call_function"]
    label, declined = _label(nodes, delegates)
    groups = _grow(nodes, label)
    small = [g for g in groups if label[g[0]] != EAGER and _ops(g) < min_ops]
    for g in small:
        for n in g:
            if _ops(g):  # a region of views alone is free on eager: nothing was declined
                declined.setdefault(n.name, []).append(
                    (label[n], f"its region has {_ops(g)} op(s), below the minimum of {min_ops}"))
            label[n] = EAGER
    if small:
        groups = _grow(nodes, label)
    return Plan([Partition(label[g[0]], tuple(g)) for g in groups], declined)


def _ops(group) -> int:
    """Ops that compute: views and getitem are free in eager and a copy in most delegates."""
    return sum(1 for n in group if n.target is not operator.getitem and not getattr(n.target, "is_view", False))


def _label(nodes: list[fx.Node], delegates: Sequence[Delegate]) -> tuple[dict, dict]:
    label: dict[fx.Node, str] = {}
    declined: dict[str, list[tuple[str, str]]] = {}
    for n in nodes:
        if n.target is operator.getitem:  # goes with the node whose output it unpacks
            label[n] = label[n.args[0]]
            continue
        # a state update writes the caller's tensor: a delegate whose results are new tensors
        # cannot run it (getattr: a delegate that does not say it can, cannot)
        writes, scalar = _writes_in_place(n), _reads_scalar(n)
        for d in delegates:
            if scalar and not getattr(d, "scalar_inputs", False):
                verdict = Support(False, _SCALAR)
            elif writes and not getattr(d, "writes_in_place", False):
                verdict = Support(False, _IN_PLACE)
            elif not getattr(d, "dynamic", False) and _varies(n):
                verdict = Support(False, _VARIES)
            else:
                verdict = d.supports(n)
            if verdict:
                label[n] = d.name
                break
            declined.setdefault(n.name, []).append((d.name, verdict.reason))
        else:
            label[n] = EAGER
    return label, declined


_IN_PLACE = "a state update written in place into the caller's tensor (a delegate's results are new tensors: it cannot write the caller's)"


_SCALAR = ("reads a Python float that changes between calls (a scalar input of the graph): this delegate "
           "compiles its scalars in, so eager runs it")


_VARIES = ("its sizes are symbols (its op sequence ran at other sizes in this process, maybe as another model: "
           "one program stands for every size, torchnative.sizes); this delegate compiles static shapes only")


def _varies(n: fx.Node) -> bool:
    return SIZES in n.meta or any(SIZES in a.meta for a in n.all_input_nodes)


def _reads_scalar(n: fx.Node) -> bool:
    return any(is_scalar(u) for u in n.all_input_nodes)


def _writes_in_place(n: fx.Node) -> bool:
    schema = getattr(n.target, "_schema", None)
    return schema is not None and schema.is_mutable


def _grow(nodes: list[fx.Node], label: dict) -> list[list[fx.Node]]:
    """Merge same-label neighbours while the partition graph stays acyclic; groups in a
    deterministic topological order."""
    if len({label[n] for n in nodes}) == 1:  # one delegate takes them all: one partition, no cycle to close
        return [list(nodes)] if nodes else []
    index = {n: i for i, n in enumerate(nodes)}
    part = dict(index)
    members = {i: [n] for i, n in enumerate(nodes)}
    q = nx.DiGraph()
    q.add_nodes_from(range(len(nodes)))
    for n in nodes:
        for u in n.all_input_nodes:
            if u in index:
                q.add_edge(index[u], index[n])
    for n in nodes:
        for u in n.all_input_nodes:
            if u not in index or label[u] != label[n]:
                continue
            a, b = part[u], part[n]
            if a != b and not _would_cycle(q, a, b):
                _merge(q, members, part, a, b)
    # Regions of one delegate that share no edge (an op on a state input alone) still join when
    # no cycle forbids it: each partition is a delegate call with its own fixed cost.
    first: dict[str, int] = {}
    for p in list(nx.lexicographical_topological_sort(q, key=lambda p: min(index[m] for m in members[p]))):
        a = first.setdefault(label[members[p][0]], p)
        if a != p and not _would_cycle(q, a, p):
            _merge(q, members, part, a, p)
    order = nx.lexicographical_topological_sort(q, key=lambda p: min(index[m] for m in members[p]))
    return [sorted(members[p], key=index.__getitem__) for p in order]


def _would_cycle(q: nx.DiGraph, a: int, b: int) -> bool:
    """Would contracting a and b close a cycle, i.e. is there a path between them through
    another partition?"""
    for src, dst in ((a, b), (b, a)):
        if any(s != dst and nx.has_path(q, s, dst) for s in q.successors(src)):
            return True
    return False


def _merge(q: nx.DiGraph, members: dict, part: dict, a: int, b: int) -> None:
    for p in q.predecessors(b):
        if p != a:
            q.add_edge(p, a)
    for s in q.successors(b):
        if s != a:
            q.add_edge(a, s)
    q.remove_node(b)
    for n in members[b]:
        part[n] = a
    members[a] += members.pop(b)

"""The recording IR: a trie of op sequences.

Each edge is one recorded step — an input entering the graph, or an op with its arguments
encoded (tensors as slot references, scalars exactly). The node reached after the last step *is*
the incremental structural key of the pending graph, and each node carries what the step
produced (output slots and metadata, source line), so a graph recorded before is recorded again
with one lookup per op (a comparison with the node's first child, most often) and no shape
inference.
"""
from __future__ import annotations

import operator
import sys
from dataclasses import dataclass
from typing import Any

import torch.fx as fx

from torchnative import events
from torchnative.recording.meta import meta_tensor
from torchnative.sizes import Flat, meta_ints
from torchnative.ir import CapturedGraph, Role, module_of

INPUT = "input"


# A reference to a graph value by slot: an interned string, tagged as recording/meta.py tags
# floats ("\0%" and the slot number). Not an object of a class of ours: CPython's collector
# tracks every instance of a class, and so every tuple that holds one (a trie key, an op's
# arguments), and a long chat process's full collections grew with them (~4 tracked objects a
# recorded op); a tuple of strings and ints it stops tracking.
Ref = str
REFS: list[Ref] = [sys.intern(f"\0%{i}") for i in range(4096)]  # grown by TrieNode: REFS[slot] always exists


def is_ref(x: Any) -> bool:
    return type(x) is str and x[:2] == "\0%"


def slot_of(ref: Ref) -> int:
    return int(ref[2:])


class TrieNode:
    __slots__ = ("parent", "op", "args", "kwargs", "out_slots", "out_metas", "sequence",
                 "is_view", "role", "stack", "first_key", "first", "others", "next_slot", "n_ops", "answers", "absolute")

    def __init__(self, parent: "TrieNode | None", op: Any, args: tuple, kwargs: tuple,
                 out_metas: tuple, sequence: bool, is_view: bool = False, role: str = "",
                 stack: tuple | None = None, absolute: bool = False):
        self.parent = parent
        self.op = op
        self.args = args
        self.kwargs = kwargs
        first = parent.next_slot if parent is not None else 0
        self.out_slots = tuple(range(first, first + len(out_metas)))
        self.next_slot = first + len(out_metas)
        if self.next_slot > len(REFS):
            REFS.extend(sys.intern(f"\0%{i}") for i in range(len(REFS), 2 * self.next_slot))
        self.out_metas = out_metas
        self.sequence = sequence
        self.is_view = is_view
        self.role = role
        self.stack = stack
        # the children, by step: the first one in slots, the others (a new size, a branch) in a
        # dict made for them. Most nodes have one child, and a dict each was a quarter of the
        # objects the collector tracked in a chat process
        self.first_key: tuple | None = None
        self.first: TrieNode | None = None
        self.others: dict | None = None
        self.answers: dict | None = None  # data reads answered here without a cut (Recorder.read)
        # ops recorded on the path to here (inputs are not ops)
        self.n_ops = (parent.n_ops + (op != INPUT)) if parent is not None else 0
        # an op on the path to here takes a storage offset (as_strided): the graph's result depends
        # on where its inputs sit in their storages, which an input's key leaves out
        self.absolute = absolute or (parent is not None and parent.absolute)
        global _nodes
        _nodes += 1

    def child(self, key: tuple) -> "TrieNode | None":
        """The node the step `key` leads to from here, if it was recorded."""
        if self.first_key == key:
            return self.first
        return self.others.get(key) if self.others is not None else None

    def add(self, key: tuple, node: "TrieNode") -> "TrieNode":
        if self.first is None:
            self.first_key, self.first = key, node
        elif self.others is None:
            self.others = {key: node}
        else:
            self.others[key] = node
        return node

    def path(self) -> list["TrieNode"]:
        nodes, n = [], self
        while n.parent is not None:
            nodes.append(n)
            n = n.parent
        nodes.reverse()
        return nodes


# Nodes the trie keeps before it starts over: every size never recorded records a path (a GPT-2
# small decode step ~1500 nodes), and a process that runs for hours must level off. Starting over
# costs the next calls of each graph a cold recording, and a graph of one size its compile again
# (programs are keyed by trie path); templates, keyed by op sequence, carry over.
LIMIT = 1 << 18
_nodes = 0
ROOT = TrieNode(None, None, (), (), (), False)


def bound() -> None:
    """Start the trie over if it holds more than LIMIT nodes (between graphs: a recording in
    progress keeps its own path)."""
    if _nodes > LIMIT:
        events.STATS.evicted["trie nodes"] += _nodes
        forget()


def forget() -> None:
    global _nodes
    ROOT.first_key = ROOT.first = ROOT.others = None
    _nodes = 0


def _decode(x: Any, env: dict) -> Any:
    tp = type(x)
    if tp is tuple:
        return [_decode(v, env) for v in x]
    if tp is str and x[:1] == "\0":
        tag = x[1]
        if tag == "%":
            return env[int(x[2:])]
        if tag == "f":
            return float.fromhex(x[2:])
        if tag == "c":
            return complex(x[2:])
        return tag == "T"
    return x


@dataclass(frozen=True)
class Signature:
    """Which slots leave the graph: live outputs, and (input slot, new value slot) state writes."""
    outputs: tuple
    state: tuple


@dataclass(frozen=True)
class Recorded:
    """A recorded graph as the layers after recording see it: a key (equal for the same trie path
    and signature; hashable, cheap) that the recorder hands over with each graph it flushes, and
    what can be asked of the graph. Trie nodes stay in recording/."""
    node: TrieNode
    sig: Signature

    def graph(self, made: list | None = None) -> CapturedGraph:
        return build_graph(self.node, self.sig, made)

    def flat(self) -> Flat:
        return flatten(self.node, self.sig)

    def skeleton(self) -> tuple:
        """The op sequence, with the inputs' ranks and dtypes: what graphs at other sizes share."""
        path = self.node.path()
        inputs = [n.out_metas[0] for n in path if n.op == INPUT]  # a scalar input's is None
        return tuple(n.op for n in path if n.op != INPUT), tuple(m and (len(m[0]), m[3]) for m in inputs)

    def input_shapes(self) -> tuple:
        return tuple(m and m[0] for m in (n.out_metas[0] for n in self.node.path() if n.op == INPUT))

    def input_roles(self) -> list[str]:
        return [n.role for n in self.node.path() if n.op == INPUT]

    def placeholder_roles(self) -> list[Role]:
        """The roles `graph()`'s placeholders get, without building it (an input the graph writes: state)."""
        written = {s for s, _ in self.sig.state}
        return ["state" if n.out_slots[0] in written else n.role for n in self.node.path() if n.op == INPUT]

    @property
    def n_ops(self) -> int:
        return self.node.n_ops

    @property
    def absolute(self) -> bool:
        """Does an op of it take a storage offset (its result depends on where inputs sit)?"""
        return self.node.absolute


def flatten(node: TrieNode, sig: Signature) -> Flat:
    """The graph recorded up to `node` as its integers and everything else (torchnative.sizes),
    without building it: positions are (path index, "args" | "kwargs", …) for arguments and
    (path index, "input" | "out", output, "shape" | "stride" | "offset", …) for metadata."""
    structure: list = [("sig", sig.outputs, sig.state)]
    ints: list[int] = []
    where: list[tuple] = []

    def leaf(x: Any, at: tuple) -> None:
        tp = type(x)
        if tp is int:
            structure.append(0)
            ints.append(x)
            where.append(at)
        elif tp is str and x[:2] == "\0%":
            structure.append(("%", int(x[2:])))
        elif tp is tuple:
            structure.append((tuple, len(x)))
            for i, v in enumerate(x):
                leaf(v, (*at, i))
        else:  # None, a string, a tagged scalar, a dtype, a device, a memory format
            structure.append(x)

    for k, n in enumerate(node.path()):
        structure.append((n.op, n.role))
        for i, a in enumerate(n.args):
            leaf(a, (k, "args", i))
        for name, v in n.kwargs:
            structure.append(name)
            leaf(v, (k, "kwargs", name))
        kind = "input" if n.op == INPUT else "out"
        for i, m in enumerate(n.out_metas):
            if m is None:
                structure.append(None)
            else:
                meta_ints(m, structure, ints, where, (k, kind, i))
    return Flat(structure, ints, where)


def _refs(x: Any, into: set) -> None:
    if is_ref(x):
        into.add(slot_of(x))
    elif type(x) is tuple:
        for v in x:
            _refs(v, into)


def _needed(path: list[TrieNode], sig: Signature) -> set[int]:
    """The ids of the op nodes of `path` that the signature's values are computed from."""
    slots = set(sig.outputs) | {s for _, s in sig.state}
    needed = set()
    for n in reversed(path):
        if n.op != INPUT and slots.intersection(n.out_slots):
            needed.add(id(n))
            _refs(n.args, slots)
            for _, v in n.kwargs:
                _refs(v, slots)
    return needed


def build_graph(node: TrieNode, sig: Signature, made: list | None = None, pruned: bool = False) -> CapturedGraph:
    """The CapturedGraph (Core ATen fx.GraphModule + roles) for the path ending at `node`.
    `made` gets, per path index, the fx node made for it and the nodes of its outputs. `pruned`:
    ops the signature does not need are left out before building (a read's few ops on a long path)."""
    g = fx.Graph()
    env: dict = {}
    roles: list[Role] = []
    state_inputs = {s for s, _ in sig.state}
    position: dict[int, int] = {}  # input slot -> placeholder index
    path = node.path()
    needed = _needed(path, sig) if pruned else None
    for n in path:
        if needed is not None and n.op != INPUT and id(n) not in needed:
            continue
        if n.op == INPUT:
            slot = n.out_slots[0]
            p = g.placeholder(f"in_{slot}")
            p.meta["val"] = 0.0 if n.role == "scalar" else meta_tensor(n.out_metas[0])
            position[slot] = len(roles)
            roles.append("state" if slot in state_inputs else n.role)
            env[slot] = p
            if made is not None:
                made.append((p, [p]))
            continue
        args = tuple(_decode(a, env) for a in n.args)
        kwargs = {k: _decode(v, env) for k, v in n.kwargs}
        call = g.call_function(n.op, args, kwargs)
        call.meta["stack"] = n.stack
        if n.sequence:
            call.meta["val"] = [None if m is None else meta_tensor(m) for m in n.out_metas]
            items = []
            for i, (slot, m) in enumerate(zip(n.out_slots, n.out_metas)):
                item = None
                if m is not None:
                    item = g.call_function(operator.getitem, (call, i))
                    item.meta["val"] = meta_tensor(m)
                    item.meta["stack"] = n.stack
                    env[slot] = item
                items.append(item)
        else:
            call.meta["val"] = meta_tensor(n.out_metas[0])
            env[n.out_slots[0]] = call
            items = [call]
        if made is not None:
            made.append((call, items))
    outs = [env[s] for s in sig.outputs] + [env[s] for _, s in sig.state]
    g.output(outs)
    g.eliminate_dead_code()
    gm = module_of(g)
    out_roles = ["output"] * len(sig.outputs) + ["state_update"] * len(sig.state)
    return CapturedGraph(gm, roles, out_roles, writes=tuple(position[s] for s, _ in sig.state))

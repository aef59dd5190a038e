"""A partition as a graph of its own (what fx's `fuse_by_partitions` does): the parent's values it
reads become its placeholders, with their roles (weights become its constants), and the values it
computes that the rest of the parent reads become its outputs."""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph, OutputRole, Role, is_weight, module_of
from torchnative.partitioner.partition import Partition
from torchnative.sizes import argument_symbols, shape_rules


@dataclass
class Subgraph:
    graph: CapturedGraph
    reads: list[fx.Node]    # the parent's values it reads, in the order of its placeholders
    outputs: list[fx.Node]  # the parent's values it computes that others read, in the order of its outputs


def written_back(parent: CapturedGraph) -> set[fx.Node]:
    """Values that are outputs only as a state's new value (a KV cache's counter + 1)."""
    outputs = parent.outputs()
    regular = {n for n, role in zip(outputs, parent.output_roles) if role != "state_update"}
    return {n for n, role in zip(outputs, parent.output_roles) if role == "state_update"} - regular


def _written_into(parent: CapturedGraph, inside: set[fx.Node], reads: list[fx.Node],
                  outputs: list[fx.Node]) -> tuple[tuple[int, int], ...]:
    """(output, placeholder) of the partition for each new value of a parent input the partition
    both reads and computes, where every reader of the old value is inside it: a delegate may then
    keep that input as its own state, written at the end (passes/state.whole_writes)."""
    placeholders = parent.placeholders()
    new = parent.outputs()[len(parent.outputs()) - len(parent.writes):]
    pairs = []
    for value, i in zip(new, parent.writes):
        old = placeholders[i]
        if value in outputs and old in reads and all(u in inside for u in old.users):
            pairs.append((outputs.index(value), reads.index(old)))
    return tuple(pairs)


def _carriers(parent: CapturedGraph, nodes: tuple[fx.Node, ...], reads: list[fx.Node]) -> list[fx.Node]:
    """Inputs of the parent that size a symbol the partition's integers follow and none of its
    own inputs has (an `arange(L)` whose partition reads no tensor of length L): the partition
    takes them too, to read the symbol off their size (torchnative.sizes.symbolic)."""
    missing = argument_symbols(list(nodes)) - {r.symbol for n in reads for r in shape_rules(n).values()}
    carriers = []
    for p in parent.placeholders():
        sized = {r.symbol for r in shape_rules(p).values()} & missing
        if sized:
            carriers.append(p)
            missing -= sized
    return carriers


def extract(parent: CapturedGraph, part: Partition, inputs: list[torch.Tensor], only_written_back: set[fx.Node],
            samples: list[dict[fx.Node, object]] | None = None) -> Subgraph:
    """`inputs`: the parent's placeholders' values (its weights become the subgraph's constants);
    `only_written_back`: `written_back(parent)`; `samples`: each node's value in sets of calibration
    inputs, for a delegate that calibrates."""
    index = {n: i for i, n in enumerate(parent.placeholders())}
    inside = set(part.nodes)
    reads: list[fx.Node] = []
    for n in part.nodes:
        for u in n.all_input_nodes:
            if u not in inside and u not in reads:
                reads.append(u)
    reads += _carriers(parent, part.nodes, reads)
    outputs = [n for n in part.nodes if any(user not in inside for user in n.users)]
    g = fx.Graph()
    env: dict = {}
    roles: list[Role] = []
    constants = {}
    for i in reads:
        env[i] = g.placeholder(i.name)
        env[i].meta = dict(i.meta)
        role = parent.input_roles[index[i]] if i in index else "input"
        roles.append(role)
        if is_weight(role):
            constants[i.name] = inputs[index[i]]
    for n in part.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output([env[o] for o in outputs])
    out_roles: list[OutputRole] = [
        "written_back" if n in only_written_back and all(u.op == "output" for u in n.users if u not in inside) else "output"
        for n in outputs]
    sub = CapturedGraph(module_of(g), roles, out_roles, constants, written_into=_written_into(parent, inside, reads, outputs))
    if samples is not None:
        sub.samples = [[seen[i] for i in reads] for seen in samples]
    return Subgraph(sub, reads, outputs)

"""The one IR that crosses every layer: CapturedGraph (DESIGN.md §2)."""
from __future__ import annotations

import hashlib
from collections import Counter
from dataclasses import dataclass, field
from typing import Literal

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

from torchnative.sizes import SIZES, dynamic_dims, export_sized, symbolic
from torchnative.quiet import quiet

# meta a pass derives and lowering depends on (part of the key): the value's last dim repeats its
# first half (passes.fuse.mark_halves), so a fused RoPE kernel may read that half alone
HALVES = "repeats_halves"

def module_of(g: fx.Graph) -> fx.GraphModule:
    """A module running `g`, its Python code generated when first run or read (fx's lazy module,
    as inductor's): passes rewrite a graph several times before anything runs it, and each
    `recompile` of a 500-op graph costs ~25 ms."""
    return _LazyGraphModule(torch.nn.Module(), g)


Role = Literal["input", "param", "pinned", "state", "constant", "scalar"]
# "scalar": a Python float passed at run time (a BatchNorm momentum that decays every call), whose
# placeholder's meta "val" is a float; only eager runs the ops that read it (partitioner)
# "written_back": a partition's output that is only a state's new value, copied into the state
# by the caller right after the run and read by nothing else; a delegate may return it in a
# buffer it reuses on every call
OutputRole = Literal["output", "state_update", "written_back"]
# roles whose values are weights: known when the graph is built, the same on every call, so a
# delegate may bake them into its artifact (and passes fold or quantize them)
WEIGHT_ROLES = ("param", "constant")


def is_weight(role: Role) -> bool:
    return role in WEIGHT_ROLES


def _is_state_value(n: fx.Node, states: frozenset[str]) -> bool:
    """A state placeholder, or its in-place write (which returns it)."""
    return n.op == "placeholder" and n.name in states or \
        n.target in (torch.ops.aten.index_put_.default, torch.ops.aten.copy_.default) and _is_state_value(n.args[0], states)


@dataclass
class CapturedGraph:
    """A Core ATen `fx.GraphModule` plus the role of each placeholder and output.

    Every call node carries `meta["val"]` (a meta tensor: shape/dtype/stride) and
    `meta["stack"]` ((filename, line) of the user code that issued it); every placeholder its
    role as `meta["role"]` too, for a delegate's `supports(node)`, which sees nodes alone.
    """
    gm: fx.GraphModule
    input_roles: list[Role]
    output_roles: list[OutputRole]
    # values of `param` placeholders (by name) that a delegate may bake into its artifact
    constants: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    # sets of values of every placeholder (those seen when the graph was built, and any from
    # `torchnative.calibrate()`), for delegates that calibrate (quantized activations); set only
    # when such a delegate compiles it
    samples: list[list[torch.Tensor]] | None = field(default=None, repr=False)
    # for each `state_update` output, in order: the index of the placeholder whose tensor it is
    # written into after the run
    writes: tuple[int, ...] = ()
    # a partition's (output, placeholder) pairs: the output is the placeholder's new value, written
    # back after the run, and nothing outside the partition reads the old one (partitioner/subgraph.py)
    written_into: tuple[tuple[int, int], ...] = ()
    _key: str | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        for p, role in zip(self.placeholders(), self.input_roles):
            p.meta["role"] = role

    def copy(self) -> "CapturedGraph":
        """The same graph in new nodes (each meta dict copied, its values shared), for passes
        that rewrite it: the captured graph stays as recorded, to be prepared again (a weight
        pinned, other delegates)."""
        g = fx.Graph()
        g.output(g.graph_copy(self.gm.graph, {}))
        return CapturedGraph(module_of(g), list(self.input_roles), list(self.output_roles),
                             self.constants, self.samples, self.writes, self.written_into)

    def placeholders(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "placeholder"]

    def output_node(self) -> fx.Node:
        return next(n for n in reversed(self.gm.graph.nodes) if n.op == "output")

    def outputs(self) -> list[fx.Node]:
        """The values the graph returns, in order."""
        return list(self.output_node().args[0])

    def runtime_inputs(self) -> int:
        """How many placeholders are passed at run time: all but the weights."""
        return sum(1 for r in self.input_roles if not is_weight(r))

    def op_nodes(self) -> list[fx.Node]:
        return [n for n in self.gm.graph.nodes if n.op == "call_function" and isinstance(n.target, torch._ops.OpOverload)]

    def ops(self) -> list[str]:
        return [str(n.target) for n in self.op_nodes()]

    def op_counts(self) -> Counter:
        return Counter(self.ops())

    def to_exported_program(self, dense: bool = False, states: frozenset[str] = frozenset()) -> "torch.export.ExportedProgram":
        """Export of the graph for torch.export-based delegates: constants (params) become
        module buffers, which export lifts into weights the delegate may prepack; example inputs
        are strided like the real ones, since a view in the graph may only be valid on those —
        unless `dense`: for a delegate whose tensors have no strides (Core ML), which is given
        contiguous inputs and where a view is a reshape. A graph whose sizes vary (torchnative.sizes)
        is exported for every size its rules allow (`dynamic_shapes`). `states`: placeholders that become
        buffers (zeros) the graph writes in place: export's mutable buffers (Core ML's states);
        outputs that are those buffers are left out."""
        root = torch.nn.Module()
        g = fx.Graph()
        env: dict = {}
        examples, dynamic, roots = [], [], {}
        for n in symbolic(self.gm).graph.nodes:  # integers that follow a symbol computed from sizes
            if n.op == "placeholder" and (n.name in self.constants or n.name in states):
                v = n.meta["val"]
                root.register_buffer(n.name, self.constants[n.name].detach() if n.name in self.constants
                                     else torch.zeros(v.shape, dtype=v.dtype))
                env[n] = g.get_attr(n.name)
                continue
            if n.op == "output" and states:
                kept = [a for a in n.args[0] if not _is_state_value(a, states)]
                env[n] = g.output(tuple(env[a] for a in kept))
                continue
            env[n] = g.node_copy(n, env.__getitem__)
            env[n].meta = {}  # torch.export mistakes our meta["val"] (device "meta") for constants
            if dense and n.target is torch.ops.aten.view.default:
                # the delegate's tensors have no strides, and a decomposition (attention's) may lay
                # out what a view reads otherwise than eager did
                env[n].target = torch.ops.aten.reshape.default
            if n.op == "placeholder":
                v = n.meta["val"]
                examples.append(torch.zeros(v.shape, dtype=v.dtype) if dense else torch.zeros_like(v, device="cpu"))
                dynamic.append(dynamic_dims(n, roots))
        with quiet():
            return export_sized(fx.GraphModule(root, g), tuple(examples), tuple(dynamic) if roots else None)

    @property
    def key(self) -> str:
        """Deterministic hash of ops, argument structure, scalars, input metadata and roles."""
        if self._key is None:
            h = hashlib.sha256()
            for n in self.gm.graph.nodes:
                val = n.meta.get("val")
                meta = (tuple(val.shape), tuple(val.stride()), val.dtype, n.meta.get(HALVES, False)) \
                    if isinstance(val, torch.Tensor) else None
                h.update(repr((n.op, str(n.target), n.args, n.kwargs, meta, n.meta.get(SIZES))).encode())
            h.update(repr((self.input_roles, self.output_roles, self.writes, self.written_into)).encode())
            self._key = h.hexdigest()
        return self._key

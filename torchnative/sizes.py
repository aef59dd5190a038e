"""Sizes that vary between calls become symbols (DESIGN.md §3), as torch.compile's automatic
dynamic does: one graph for every size, not one per size.

A graph recorded at two sizes — a decode step over a cache that grows by a token, a prompt of
another length — has the same structure twice, with other integers: its inputs' dims, the sizes
its views and factories name, its values' shapes. `fit` takes the two (as `Flat`s: integers and
everything else) and finds, for each integer, how it follows from the inputs' dims that changed,
the *symbols*: a constant, or `coef · s + const` (coef > 0). The later graph, its nodes marked
with those rules (`node.meta["sizes"]`, cache/templates.py), stands for every size:
`Sizes.match` checks a graph recorded at a new size against every rule — shapes, dense layouts
and strides, arguments — and a graph that breaks one (a relation two inputs kept, a size out of
range) is not this graph. `symbolic` rewrites a graph so that its integer arguments are computed
from its inputs' sizes: what eager runs and what torch.export-based delegates export with
`dynamic_shapes`.

Why fit, not trace: Python computes the integers (`view(1, L + 1, 12, 64)`) from sizes it read
eagerly, and the door sees only their values. Two samples fix a rule in one symbol; every later
size is checked against all of them exactly, so a coincidence of two samples costs a recording,
never a wrong result.
"""
from __future__ import annotations

import operator
from dataclasses import dataclass, replace
from typing import Any

import torch
import torch.fx as fx
from torch.fx._lazy_graph_module import _LazyGraphModule

SIZES = "sizes"  # node.meta key: {where: Rule} for the node's integers that follow a symbol
_LOW = 2  # a symbol is at least 2: torch.export specializes sizes 0 and 1
HIGH = 1 << 20


@dataclass(frozen=True)
class Rule:
    """An integer as `coef · symbol + const` (a constant when `symbol` is -1); the symbol's range."""
    const: int
    coef: int = 0
    symbol: int = -1
    low: int = _LOW
    high: int = HIGH

    def value(self, values: list[int]) -> int:
        """The integer at the symbols' `values`."""
        return self.const + self.coef * values[self.symbol] if self.symbol >= 0 else self.const


def dense_order(shape: tuple, stride: tuple) -> tuple | None:
    """The dims (of size > 1), outermost first, of a tensor laid out densely in that order; None
    for a strided view (a slice, an expansion). Size-1 dims address nothing: their strides are
    whatever the kernel left."""
    dims = sorted((d for d in range(len(shape)) if shape[d] != 1), key=lambda d: -stride[d])
    step = 1
    for d in reversed(dims):
        if stride[d] != step:
            return None
        step *= shape[d]
    return tuple(dims)


def dense_strides(shape: tuple, order: tuple) -> tuple:
    """The strides of a tensor of `shape` laid out densely in `order` (size-1 dims: contiguous)."""
    stride, step = [0] * len(shape), 1
    for d in reversed(order):
        stride[d], step = step, step * shape[d]
    for d in range(len(shape) - 1, -1, -1):
        if d not in order:
            stride[d] = stride[d + 1] * shape[d + 1] if d + 1 < len(shape) else 1
    return tuple(stride)


@dataclass
class Flat:
    """A graph as the integers that may vary (`ints`) and everything else (`structure`), each
    integer with where it is (`where`, the recording's own positions: recording.trie.flatten)."""
    structure: list
    ints: list[int]
    where: list[tuple]


def meta_ints(meta: tuple, structure: list, ints: list[int], where: list[tuple], at: tuple) -> None:
    """A value's metadata (shape, stride, offset, dtype) into a Flat's lists: shape and offset as
    integers, strides as the order a dense value's dims are laid out in, or as integers for a
    strided view."""
    shape, stride, offset, dtype = meta
    order = dense_order(shape, stride)
    structure.append(("T", dtype, len(shape), order))
    for d, size in enumerate(shape):
        structure.append(0)
        ints.append(size)
        where.append((*at, "shape", d))
    if order is None:
        for d, st in enumerate(stride):
            structure.append(0)
            ints.append(st)
            where.append((*at, "stride", d))
    structure.append(0)
    ints.append(offset)
    where.append((*at, "offset"))


def is_shape(at: tuple) -> bool:
    """Is the integer at `at` (a Flat's position) a value's size?"""
    return at[1] in ("input", "out") and at[3] == "shape"


def is_input_size(at: tuple) -> bool:
    return at[1] == "input" and at[3] == "shape"


def relate(x: int, y: int, before: list[int], after: list[int]) -> Rule | None:
    """A rule in one of the symbols (values `before` in the first sample, `after` in the second)
    that takes x to y, with a positive coefficient; 1 first."""
    found = None
    for j, (a, b) in enumerate(zip(before, after)):
        if (y - x) % (b - a) == 0 and (y - x) // (b - a) > 0:
            rule = Rule(y - (y - x) // (b - a) * b, (y - x) // (b - a), j)
            if rule.coef == 1:
                return rule
            found = found or rule
    return found


@dataclass
class Sizes:
    """The rules of a graph structure seen at two sizes, and each symbol's range."""
    structure: list
    rules: list[Rule]
    defs: list[int]            # per symbol: the position of the integer (an input's dim) it is read from
    ranges: list[tuple[int, int]]

    def narrowed(self, ranges: dict) -> "Sizes":
        """These rules, each symbol's range narrowed to `ranges` (symbol -> (low, high))."""
        both = narrowest(dict(enumerate(self.ranges)), ranges)
        rules = [replace(r, low=both[r.symbol][0], high=both[r.symbol][1]) if r.symbol >= 0 else r for r in self.rules]
        return replace(self, rules=rules, ranges=[both[j] for j in range(len(self.ranges))])

    def match(self, flat: Flat) -> list[int] | None:
        """The symbols' values for a graph of this structure whose every integer follows its
        rule, else None."""
        if flat.structure != self.structure:
            return None
        values = [flat.ints[k] for k in self.defs]
        if not all(lo <= v <= hi for v, (lo, hi) in zip(values, self.ranges)):
            return None
        for rule, x in zip(self.rules, flat.ints):
            if rule.value(values) != x:
                return None
        return values


def fit(a: Flat, b: Flat) -> Sizes | None:
    """The rules that take `a`'s integers to `b`'s, with the inputs' dims that differ as the
    symbols, or None when the structures differ or an integer follows no symbol. The rules are
    `b`'s: with them, it stands for every size that matches."""
    if a.structure != b.structure:
        return None
    before: list[int] = []
    after: list[int] = []
    defs: list[int] = []
    rules: list[Rule] = [Rule(0)] * len(b.ints)
    # the inputs' dims first: a factory may name a size before the graph reads its first input
    inputs = {k for k, at in enumerate(b.where) if is_input_size(at)}
    for k in sorted(range(len(b.ints)), key=lambda k: k not in inputs):
        x, y = a.ints[k], b.ints[k]
        rule = Rule(y) if x == y else relate(x, y, before, after)
        if rule is None:
            if k not in inputs or min(x, y) < _LOW:
                return None
            rule = Rule(0, 1, len(defs))
            defs.append(k)
            before.append(x)
            after.append(y)
        rules[k] = rule
    if not defs:
        return None
    unbounded = Sizes(b.structure, rules, defs, [(_LOW, HIGH)] * len(defs))
    return unbounded.narrowed(dict(enumerate(_ranges(rules, b.where, len(defs)))))


def _ranges(rules: list[Rule], where: list, n: int) -> list[tuple[int, int]]:
    """Each symbol's range: every dim it sizes stays at least 2 (torch.export's 0/1 specialization)."""
    low = [_LOW] * n
    for rule, at in zip(rules, where):
        if rule.symbol >= 0 and is_shape(at):
            low[rule.symbol] = max(low[rule.symbol], -((rule.const - _LOW) // rule.coef))
    return [(lo, HIGH) for lo in low]


def is_symbolic(gm: fx.GraphModule) -> bool:
    return any(SIZES in n.meta for n in gm.graph.nodes)


def shape_rules(node: fx.Node) -> dict[int, Rule]:
    """The dims of a node's value that follow a symbol."""
    return {w[1]: r for w, r in node.meta.get(SIZES, {}).items() if w[0] == "shape"}


def symbol_sources(placeholders: list[fx.Node]) -> dict[int, tuple[int, int, Rule]]:
    """Per symbol, where a graph's inputs carry it: (placeholder index, dim, its rule there); a
    dim that is the symbol itself (coefficient 1) where one is, so reading it needs no division."""
    found: dict[int, tuple[int, int, Rule]] = {}
    for k, p in enumerate(placeholders):
        for d, r in shape_rules(p).items():
            if r.symbol not in found or (r.coef == 1 and found[r.symbol][2].coef != 1):
                found[r.symbol] = (k, d, r)
    return found


def symbol_values(gm: fx.GraphModule) -> dict[int, int]:
    """Each symbol's value in the graph as recorded, read from its inputs' shapes."""
    placeholders = list(gm.graph.find_nodes(op="placeholder"))
    return {j: (placeholders[k].meta["val"].shape[d] - r.const) // r.coef
            for j, (k, d, r) in symbol_sources(placeholders).items()}


def bucket(size: int) -> int:
    """The largest size a program built at `size` takes on a delegate that plans its memory for
    the largest (ExecuTorch): the power of two at least twice it. A program per doubling, none
    sized for the million a rule allows."""
    return 1 << (2 * size - 1).bit_length()


def narrowest(*ranges: dict) -> dict[int, tuple[int, int]]:
    """Each symbol's range in all of `ranges` (symbol -> (low, high); keys as text read as ints)."""
    both: dict[int, tuple[int, int]] = {}
    for given in ranges:
        for j, (lo, hi) in given.items():
            old = both.get(int(j), (lo, hi))
            both[int(j)] = (max(old[0], lo), min(old[1], hi))
    return both


def bounded(gm: fx.GraphModule) -> dict[str, list[int]]:
    """`gm`'s rules with an upper bound: a symbol no range bounds (HIGH) up to the bucket of its
    size as recorded. Each symbol's range, by symbol (as text: it goes into JSON). The nodes'
    size meta is replaced, not edited: a graph's copy shares it with the original."""
    highs = {j: bucket(v) for j, v in symbol_values(gm).items()}
    ranges: dict[str, list[int]] = {}
    for n in gm.graph.nodes:
        if SIZES in n.meta:
            n.meta[SIZES] = {w: replace(r, high=highs[r.symbol]) if r.symbol >= 0 and r.high == HIGH else r
                             for w, r in n.meta[SIZES].items()}
            ranges.update((str(r.symbol), [r.low, r.high]) for r in n.meta[SIZES].values() if r.symbol >= 0)
    return ranges


def argument_symbols(nodes: list[fx.Node]) -> set[int]:
    """The symbols the nodes' integer arguments follow."""
    return {r.symbol for n in nodes for w, r in n.meta.get(SIZES, {}).items() if w[0] in ("args", "kwargs")}


def _set(args: Any, path: tuple, value: Any) -> Any:
    """`args` with the leaf at `path` replaced (lists and tuples rebuilt on the way)."""
    if not path:
        return value
    items = list(args)
    items[path[0]] = _set(items[path[0]], path[1:], value)
    return type(args)(items)


def symbolic(gm: fx.GraphModule) -> fx.GraphModule:
    """`gm` with every integer argument that follows a symbol computed from a placeholder's size
    (`sym_size`), so it runs, and exports, at any size its rules allow. Raises LookupError when a
    symbol sizes no placeholder (extract passes one that does)."""
    if not is_symbolic(gm):
        return gm
    nodes = list(gm.graph.nodes)
    g = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    placeholders = [n for n in nodes if n.op == "placeholder"]
    for n in placeholders:
        env[n] = g.node_copy(n)
    source = {j: (env[placeholders[k]], d, r) for j, (k, d, r) in symbol_sources(placeholders).items()}
    symbols: dict[int, fx.Node] = {}

    def value(rule: Rule) -> Any:
        j = rule.symbol
        if j not in symbols:
            if j not in source:
                raise LookupError(f"symbol s{j} sizes none of the graph's inputs")
            p, d, r = source[j]
            s = g.call_function(torch.ops.aten.sym_size.int, (p, d))
            s = g.call_function(operator.sub, (s, r.const)) if r.const else s
            symbols[j] = g.call_function(operator.floordiv, (s, r.coef)) if r.coef != 1 else s
        s = symbols[j]
        s = g.call_function(operator.mul, (s, rule.coef)) if rule.coef != 1 else s
        return g.call_function(operator.add, (s, rule.const)) if rule.const else s

    for n in nodes:
        if n.op == "placeholder":
            continue
        args, kwargs = n.args, dict(n.kwargs)
        for where, rule in n.meta.get(SIZES, {}).items():
            if where[0] == "args":
                args = _set(args, where[1:], value(rule))
            elif where[0] == "kwargs":
                kwargs[where[1]] = _set((kwargs[where[1]],), (0, *where[2:]), value(rule))[0]
        env[n] = g.node_copy(n, lambda a: env[a])
        if SIZES in n.meta:  # the new arguments hold this graph's symbol nodes and the old graph's others
            env[n].args, env[n].kwargs = fx.map_arg((args, kwargs), lambda a: env.get(a, a))
    return _LazyGraphModule(gm, g)  # its code generated when first run (delegates/eager.py walks it before)


def dynamic_dims(placeholder: fx.Node, roots: dict[int, Any]) -> dict[int, Any] | None:
    """torch.export's `dynamic_shapes` entry for a placeholder: each dim that follows a symbol as
    that symbol's `Dim` (one per symbol, in `roots`, with its range) or a multiple and offset of it."""
    from torch.export import Dim

    spec = {}
    for d, r in shape_rules(placeholder).items():
        root = roots.get(r.symbol)
        if root is None:
            root = roots[r.symbol] = Dim(f"s{r.symbol}", min=r.low, max=r.high)
        spec[d] = root * r.coef + r.const if (r.coef, r.const) != (1, 0) else root
    return spec or None


def export_sized(module: torch.nn.Module, examples: tuple, dynamic: tuple | None) -> "torch.export.ExportedProgram":
    """torch.export with these `dynamic_shapes`; where tracing finds a symbol's range narrower than
    its rules' (a length that slices a table of 512 positions is at most 512), exported again with
    the narrower range, which `exported_ranges` reads back. A symbol the export specializes to one
    size is refused: the graph would not stand for other sizes."""
    from torch._dynamo.exc import UserError
    from torch.export.dynamic_shapes import refine_dynamic_shapes_from_suggested_fixes

    try:
        return torch.export.export(module, examples, dynamic_shapes=dynamic)
    except UserError as e:
        if dynamic is None or "Constraints violated" not in str(e):
            raise
        violation = e.msg
    refined = refine_dynamic_shapes_from_suggested_fixes(violation, dynamic)
    specialized = [d for spec, given in zip(refined, dynamic) if spec and given
                   for d in given if isinstance(spec.get(d), int)]
    if specialized:
        raise ValueError(f"the export specializes dims that vary between calls to one size ({violation.splitlines()[0]})")
    return torch.export.export(module, examples, dynamic_shapes=refined)


def exported_ranges(exported: "torch.export.ExportedProgram", gm: fx.GraphModule) -> dict[str, list[int]]:
    """Each symbol's range in the export of `gm` (by symbol number, as text: it goes into JSON)
    where the export narrowed it."""
    from torch.utils._sympy.value_ranges import bound_sympy

    given = {n.name: n for n in gm.graph.find_nodes(op="placeholder")}
    ranges: dict[str, list[int]] = {}
    for n in exported.graph.find_nodes(op="placeholder"):
        rules = shape_rules(given[n.name]) if n.name in given else {}
        for d, r in rules.items():
            size = n.meta["val"].shape[d]
            if not isinstance(size, torch.SymInt):
                continue
            bound = bound_sympy(size.node.expr, exported.range_constraints)
            lo, hi = -(-(int(bound.lower) - r.const) // r.coef), (int(min(bound.upper, 1 << 62)) - r.const) // r.coef
            if (lo, hi) != (r.low, r.high):
                old = ranges.get(str(r.symbol), [r.low, r.high])
                ranges[str(r.symbol)] = [max(old[0], lo), min(old[1], hi)]
    return ranges

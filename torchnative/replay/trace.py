"""The trace of a recorded call: what a replay runs instead of the call's Python.

Python always runs while a call is recorded (DESIGN.md §3); that costs tens of µs per op. A call
of an accelerated module whose recording ran only compiled programs and read only scalars
(`.item()`, `bool()` of a graph value) is described by a `Trace`: which programs ran (a
`GraphCall` each), where each input came from (an argument, an earlier program's output, a
weight), which scalar Python read after which program, and how the outputs were assembled. A
call that cannot be described so raises `Ineligible`, which says why. `run` is the one
interpreter of a trace: a replayed call's, and a bundle method's, which is a trace saved
(bundle/manifest.py) and loaded back (bundle/load.py).
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections import OrderedDict
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterator, NamedTuple

from torch.utils import _pytree as pytree

from torchnative import events
from torchnative.cache.program_cache import CACHE
from torchnative.grad import copy_back
from torchnative.replay.floats import checks_hold, evaluate, values_hold
from torchnative.replay.guard import put, put_path, real
from torchnative.replay.watch import module_changes
from torchnative.build.program import baked_state


class Ineligible(Exception):
    """This call cannot be described by a trace; the message says why."""


def resolve(src: tuple, leaves: list, produced: list, snapshots: dict) -> Any:
    kind = src[0]
    if kind == "arg":
        return leaves[src[1]]
    if kind == "out":
        return produced[src[1]][src[2]]
    if kind == "field":  # a tensor an argument object holds: where it sits now
        return real(snapshots[src[1]].tensors[src[2]])
    if kind == "view":
        return resolve(src[1], leaves, produced, snapshots).as_strided(*src[2:])
    if kind == "new":  # an object the call made (tracer._made): made again
        return _build(src[1], lambda t: resolve(t, leaves, produced, snapshots))
    if kind == "calc":  # a float computed from module attributes (replay/floats.py): computed again
        return evaluate(src[1])
    return src[1]  # "const", "lit", "py"


def _build(recipe: tuple, value: Callable[[tuple], Any]) -> Any:
    """The object a recipe (tracer._made) describes, its tensors' sources given by `value`."""
    kind = recipe[0]
    if kind == "list" or kind == "tuple":
        items = [_build(r, value) for r in recipe[1]]
        return items if kind == "list" else tuple(items)
    if kind == "dict":
        return {k: _build(r, value) for k, r in recipe[1]}
    if kind == "object":
        obj = recipe[1].__new__(recipe[1])
        vars(obj).update((k, _build(r, value)) for k, r in recipe[-1])
        return obj
    return value(recipe)


def _nodes(recipe: tuple) -> Iterator[tuple]:
    """Every node of a recipe (its containers, objects, scalars and tensor sources), in order."""
    yield recipe
    kind = recipe[0]
    if kind in ("list", "tuple"):
        for r in recipe[1]:
            yield from _nodes(r)
    elif kind in ("dict", "object"):
        for _, r in recipe[-1]:
            yield from _nodes(r)


def _recipe_sources(recipe: tuple) -> Iterator[tuple]:
    """The sources of the tensors a recipe holds, in order."""
    return (n for n in _nodes(recipe) if n[0] not in ("list", "tuple", "dict", "object", "py"))


def _map_recipe(recipe: tuple, fn: Callable[[tuple], tuple], refs: bool = True) -> tuple:
    """The recipe with each tensor source `fn`'s; without `refs`, its objects' weak references left out."""
    kind = recipe[0]
    if kind == "list" or kind == "tuple":
        return (kind, tuple(_map_recipe(r, fn, refs) for r in recipe[1]))
    if kind in ("dict", "object"):
        head = recipe[:-1] if refs or kind == "dict" else recipe[:2]
        return (*head, tuple((k, _map_recipe(r, fn, refs)) for k, r in recipe[-1]))
    return recipe if kind == "py" else fn(recipe)


def _objects(recipe: tuple) -> Iterator[Any]:
    """The objects a recipe was taken of (None where freed), in order."""
    return (n[2]() for n in _nodes(recipe) if n[0] == "object")


@dataclass(frozen=True)
class GraphCall:
    program: Any                  # build.program.Program
    sources: tuple                # per input: ("arg", i) | ("out", step, j) | ("const", tensor)
                                  # | ("lit", 0-dim tensor): a Python number, the same in calls that replay
                                  # | ("field", i, k): the k-th tensor argument object i holds
                                  # | ("view", source, shape, stride, offset): an alias of a source
    reads: tuple                  # ((j, value), ...): Python read output j as this scalar
    writes: tuple = ()            # sources of the real tensors the trailing values are copied into
    # the program is eager's, run until the graph's compile repays (cache.program_cache's cost
    # rule): the key its runs' seconds count under
    timed: tuple | None = None
    # autograd recorded the call (grad on, an input that requires grad): the replay runs the
    # program's differentiable form, whose outputs carry the graph's backward
    differentiable: bool = False
    # the program is eager's, run while the delegates' one builds in the background: the build's
    # program key. A replay runs it meanwhile (a decode step replayed on eager, not recorded
    # again), and the built program once it is done: the same graph's (or template's) program,
    # which a recording of the call would run
    stands_in: tuple | None = None

    def __post_init__(self) -> None:
        # most inputs are weights ("const"): filled in once, not resolved on every call
        fixed = ("const", "lit")
        object.__setattr__(self, "_template", [s[1] if s[0] in fixed else None for s in self.sources])
        object.__setattr__(self, "_resolved", [(k, s) for k, s in enumerate(self.sources) if s[0] not in fixed])
        # the params the program baked, when the trace holds each as a "const" (it always runs
        # with them): a run checks their versions and addresses alone, in one pass (148 in a GPT-2 step)
        baked = self.program.baked
        held = all(self.sources[i][0] == "const" and self.sources[i][1] is ref() for i, ref, _ in baked)
        object.__setattr__(self, "_baked", ([self.sources[i][1] for i, _, _ in baked], [s for _, _, s in baked]) if held else None)

    def inputs(self, leaves: list, produced: list, snapshots: dict) -> list:
        inputs = self._template.copy()
        for k, s in self._resolved:
            inputs[k] = resolve(s, leaves, produced, snapshots)
        return inputs

    def valid_for(self, inputs: list) -> bool:
        """The program's `valid_for`: its baked params unchanged."""
        if self._baked is None:
            return self.program.valid_for(inputs)
        tensors, states = self._baked
        return list(map(baked_state, tensors)) == states and not self.program.retired

    def program_for(self, inputs: list) -> Any:
        """The program to run: the stand-in's built program once it is done and valid for these
        inputs (else None: the call records), the trace's own until then."""
        if self.stands_in is None or not CACHE.superseded(self.stands_in[:3]):
            return self.program
        return None if self.differentiable else CACHE.built(self.stands_in, inputs)

    def roots(self, leaves: list, produced: list, snapshots: dict) -> list:
        """The real tensors this step's trailing values are copied into."""
        return [resolve(src, leaves, produced, snapshots) for src in self.writes]


@dataclass(frozen=True)
class Trace:
    calls: tuple                  # GraphCall per program run, in order
    outputs: tuple                # per output leaf: a source, or ("py", value)
    spec: Any                     # the output's pytree structure
    module_changes: int | None    # module_changes() when the call was recorded (None: a bundle's, no module)
    # ((i, k), source): the k-th tensor argument object i holds is replaced by this value (a
    # DynamicCache's keys by the longer ones the step concatenated)
    sets: tuple = ()
    # ((hook, module, sources, spec), ...): forward hooks the call ran, called again on the
    # values (replay/hooks.py), while the model's hooks are `hook_set`
    hooks: tuple = ()
    hook_set: tuple = ()
    # ((i, offset), ...): where argument i sat in its storage, for a trace that depends on it (a view
    # of an argument among its sources, or an op taking a storage offset); the guard key leaves it out
    offsets: tuple = ()
    # ((read, weights, value), ...): data Python read of weights alone without a cut
    # (recording.recorder.WeightRead), computed again before the programs run
    checks: tuple = ()
    # ((i, path), source): a field of argument object i the call set where its structure changed (a
    # DynamicCache filled on its first call: each layer's keys, values, is_initialized, device);
    # path: the steps from the object to the field (guard.put_path)
    fills: tuple = ()
    # ((fn, operands, result), ...): what Python made of the module's dynamic float attributes
    # (comparisons, conversions; replay/floats.py), made again before the programs run
    floats: tuple = ()
    # ((weakref of a module, name, value), ...): its dynamic float attributes when the call was
    # recorded; `varied`: those two recorded calls with this trace had at different values, which a
    # replay may find at any value (the others must hold theirs)
    attrs: tuple = field(default=(), compare=False)
    varied: frozenset = field(default=frozenset(), compare=False)
    repaid: bool = field(default=False, compare=False)  # an eager program of it has repaid its compile: record again

    def held(self, snapshots: dict) -> "Trace":
        """This trace with the tensors argument objects held (at the start of the call these
        snapshots were taken at) as constants: what a bundle saves by identity."""
        def const(src: tuple) -> tuple:
            if src[0] == "field":
                return ("const", real(snapshots[src[1]].tensors[src[2]]))
            return ("view", const(src[1]), *src[2:]) if src[0] == "view" else src

        calls = tuple(replace(s, sources=tuple(map(const, s.sources)), writes=tuple(map(const, s.writes)))
                      for s in self.calls)
        return replace(self, calls=calls, outputs=tuple(map(const, self.outputs)))

    def superseded(self) -> bool:
        """Does it run an eager program whose delegates' program has been built since?"""
        return any(c.timed is not None and CACHE.superseded(c.timed) for c in self.calls)

    def same_as(self, other: "Trace", sizes: bool = True) -> bool:
        """The same programs on the same sources, reads, writes and outputs; without `sizes`, the
        sizes of the views Python took (`logits = out.view(b, n, V)`) may differ: the trace at
        another size (replay/new_sizes.py)."""
        def norm(src):
            if src[0] == "lit":
                return ("lit", src[1].dtype, src[1].item())
            if src[0] == "view":
                return ("view", norm(src[1]), *(src[2:] if sizes else (len(src[2]),)))
            if src[0] == "new":
                return ("new", _map_recipe(src[1], norm, refs=False))
            if src[0] != "const":
                return src
            t = src[1]
            # an empty tensor has no data: one a call makes anew (`torch.tensor([])` that a
            # DynamicCache's first update concatenates onto) is the same source as the last call's
            return ("empty", t.shape, t.dtype, t.device) if not t.numel() else ("const", id(t))

        def shape(t: Trace) -> list:
            return [(s.program, tuple(map(norm, s.sources)), s.reads, tuple(map(norm, s.writes))) for s in t.calls]

        def hooks(t: Trace) -> list:
            return [(id(h), id(m), tuple(map(norm, sources)), spec) for h, m, sources, spec in t.hooks]

        def checks(t: Trace) -> list:
            return [(id(read), tuple(map(id, weights)), value) for read, weights, value in t.checks]
        mine, theirs = shape(self), shape(other)
        if any(a[0] == "new" and b[0] == "new" and any(x is not None and x is y for x, y in zip(_objects(a[1]), _objects(b[1])))
               for a, b in zip(self.outputs, other.outputs)):
            return False  # an object returned again: not one the call makes (tracer._made)
        return (mine == theirs and self.spec == other.spec and self.module_changes == other.module_changes
                and [norm(o) for o in self.outputs] == [norm(o) for o in other.outputs]
                and [(at, norm(src)) for at, src in self.sets] == [(at, norm(src)) for at, src in other.sets]
                and [(at, norm(src)) for at, src in self.fills] == [(at, norm(src)) for at, src in other.fills]
                and hooks(self) == hooks(other) and self.hook_set == other.hook_set and self.offsets == other.offsets
                and checks(self) == checks(other) and self.floats == other.floats)

    def view_ints(self) -> list[int]:
        """The shapes, strides and offsets of the views among its sources, in one order."""
        ints: list[int] = []

        def collect(src: tuple) -> None:
            if src[0] == "new":
                for inner in _recipe_sources(src[1]):
                    collect(inner)
            elif src[0] == "view":
                collect(src[1])
                ints.extend((*src[2], *src[3], src[4]))
        for src in self._sources():
            collect(src)
        return ints

    def with_view_ints(self, ints: list[int]) -> "Trace":
        """This trace with its views' integers (`view_ints`'s order) replaced by `ints`."""
        if not ints:
            return self
        it = iter(ints)

        def each(src: tuple) -> tuple:
            if src[0] == "new":
                return ("new", _map_recipe(src[1], each))
            if src[0] != "view":
                return src
            base = each(src[1])
            shape = tuple(next(it) for _ in src[2])
            return ("view", base, shape, tuple(next(it) for _ in src[3]), next(it))

        def sources(srcs: tuple) -> tuple:
            return tuple(map(each, srcs))
        calls = tuple(replace(c, sources=sources(c.sources), writes=sources(c.writes))
                      if any(src[0] == "view" for src in (*c.sources, *c.writes)) else c for c in self.calls)
        return replace(self, calls=calls, outputs=sources(self.outputs),
                       sets=tuple((at, each(src)) for at, src in self.sets),
                       hooks=tuple((h, m, sources(srcs), spec) for h, m, srcs, spec in self.hooks),
                       fills=tuple((at, each(src)) for at, src in self.fills))  # in _sources' order

    def _sources(self) -> list[tuple]:
        """Every source it names, in the order `with_view_ints` visits them."""
        return [*(src for c in self.calls for src in (*c.sources, *c.writes)), *self.outputs,
                *(src for _, src in self.sets), *(src for _, _, srcs, _ in self.hooks for src in srcs),
                *(src for _, src in self.fills)]


class Miss(NamedTuple):
    """A guard of a trace failed when it ran: `step`'s program, at its `read`-th scalar read
    (None: a baked weight changed, or a module attribute was set), read `got`. Nothing was written."""
    step: int | None
    read: int | None = None
    got: Any = None


def run(trace: Trace, leaves: list, snapshots: dict, submit: Callable | None = None, hook_set: tuple = ()) -> Any:
    """The one interpreter of a trace, for a replayed call and a bundle's method alike: each
    program in order on inputs from their sources, each scalar Python read checked against the
    recorded one, then the programs' state writes (only once every guard held), the outputs
    and what the call put into its argument objects. The call's output, or a `Miss`. `submit`:
    how the programs of a call autograd records build their backward (build/differentiable.py);
    `hook_set`: the model's forward hooks now (replay/hooks.hooks_of)."""
    if trace.module_changes is not None and trace.module_changes != module_changes() or trace.hook_set != hook_set:
        return Miss(None)
    if trace.offsets and any(leaves[i].storage_offset() != at for i, at in trace.offsets):
        return Miss(None)
    for read, weights, expected in trace.checks:
        got = read(weights)
        if type(got) is not type(expected) or got != expected:
            return Miss(None)
    if trace.attrs and not (values_hold(trace.attrs, trace.varied) and checks_hold(trace.floats)):
        return Miss(None)
    produced: list[list] = []
    for k, call in enumerate(trace.calls):
        if call.timed is not None and (CACHE.superseded(call.timed) or CACHE.repaid(call.timed)):
            return Miss(k)  # its delegates' program is built, or its compile has repaid: the call records
        inputs = call.inputs(leaves, produced, snapshots)
        program = call.program_for(inputs)
        if program is None or (program is call.program and not call.valid_for(inputs)):
            return Miss(k)
        started = time.perf_counter() if call.timed is not None else 0.0
        if call.differentiable:
            values = program.differentiable(inputs, submit)
            if values is None:  # its backward is being made off the call: the call records meanwhile
                return Miss(k)
        else:
            values = program(inputs)
        # an eager program's seconds count towards its compile; once that repays, the call records again, to compile
        if call.timed is not None and CACHE.ran(call.timed, time.perf_counter() - started):
            object.__setattr__(trace, "repaid", True)
        events.STATS.graph_runs += 1
        if events.listeners:
            events.emit(events.GraphRun(program.graph, True, 0, program.partitions, True, program))
        for r, (j, expected) in enumerate(call.reads):
            got = values[j].item()
            if type(got) is not type(expected) or got != expected:
                return Miss(k, r, got)
        produced.append(values)
    for call, values in zip(trace.calls, produced):  # the programs' writes, once every guard held
        if call.writes:
            copy_back(call.roots(leaves, produced, snapshots), values[len(values) - len(call.writes):])
    out = [resolve(o, leaves, produced, snapshots) for o in trace.outputs]
    for (i, k), src in trace.sets:  # what the call put into its argument objects
        put(snapshots[i].places[k], resolve(src, leaves, produced, snapshots))
    for (i, path), src in trace.fills:
        put_path(leaves[i], path, resolve(src, leaves, produced, snapshots))
    for hook, module, sources, spec in trace.hooks:
        hook(module, *pytree.tree_unflatten([resolve(x, leaves, produced, snapshots) for x in sources], spec))
    build = trace.__dict__.get("_build")
    if build is None:
        built = pytree.tree_unflatten(out, trace.spec)
        object.__setattr__(trace, "_build", _builder(trace.spec, out, built))
        return built
    return build(out)


def _builder(spec: Any, leaves: list, built: Any) -> Callable[[list], Any]:
    """`pytree.tree_unflatten(·, spec)`, and for a flat transformers ModelOutput something
    cheaper: its dict items and attributes set directly (its __init__ and __post_init__ took 40 us
    of a decode step). Used only when it makes exactly what unflattening made of `leaves`: the
    same items and attributes, each the same object or None; otherwise unflattening it is."""
    unflatten = functools.partial(pytree.tree_unflatten, treespec=spec)
    cls = spec.type
    if spec.is_leaf() or not (issubclass(cls, OrderedDict) and dataclasses.is_dataclass(cls)) \
            or not all(c.is_leaf() for c in spec.children()) or type(built) is not cls:
        return unflatten
    keys = list(spec.context)
    attributes = {}  # attribute -> index of its item, or None
    for name, value in vars(built).items():
        same = [j for j, v in enumerate(leaves) if v is value]
        if value is not None and not same:
            return unflatten  # something __post_init__ derived
        attributes[name] = (keys.index(name) if name in keys else same[0]) if value is not None else None

    def build(values: list) -> Any:
        out = cls.__new__(cls)
        for k, v in zip(keys, values):
            OrderedDict.__setitem__(out, k, v)
        vars(out).update({name: None if j is None else values[j] for name, j in attributes.items()})
        return out

    again = build(leaves)
    same = (list(again.keys()) == list(built.keys()) and all(a is b for a, b in zip(again.values(), built.values()))
            and vars(again).keys() == vars(built).keys() and all(vars(again)[k] is v for k, v in vars(built).items()))
    return build if same else unflatten

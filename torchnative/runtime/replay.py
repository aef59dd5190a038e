"""Replay of a forward proven stable: its compiled programs run without per-op Python work.

Python always runs while a call is recorded (DESIGN.md §3); that costs tens of µs per op. A call
of an accelerated module whose recording ran only compiled programs and read only scalars
(`.item()`, `bool()` of a graph value) is described by a `Trace`: which programs ran, where each
input came from (an argument, an earlier program's output, a weight), which scalar Python read
after which program, and how the outputs were assembled. When two consecutive calls with the same
guards (argument structure and metadata, non-tensor arguments, grad mode, training flag) produced
the same trace, later calls with those guards replay it: each program runs, each scalar read is
checked against the recorded one, and a mismatch (Python would have branched differently), a
changed weight, or a re-registered parameter anywhere falls back to recording the call — the
programs run so far wrote nothing, so running the call again is safe.

An argument object (a StaticCache) is guarded by identity and Python state (runtime/guard.py); a
call that changes that state is ineligible; the tensors it reaches are read and, by the last
program, written back as the recording did. Anything else Python did with tensor data (a random
op, an eager fallback op, `.tolist()`, a tensor made from Python data) makes the call ineligible;
the reason is counted in `stats()["replay_ineligible"]`.
"""
from __future__ import annotations

import dataclasses
import functools
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from torchnative import events
from torchnative.grad import copy_back
from torchnative.runtime.guard import SCALARS, Snapshot, is_plain, object_state

aten = torch.ops.aten
_SCALAR_READ = aten._local_scalar_dense.default

# Bumped whenever any module (re)registers a parameter or buffer: a replayed trace holds the old
# tensors, so it must not outlive them.
_registrations = 0


def _bump(*_: Any) -> None:
    global _registrations
    _registrations += 1


torch.nn.modules.module.register_module_parameter_registration_hook(_bump)
torch.nn.modules.module.register_module_buffer_registration_hook(_bump)


class Ineligible(Exception):
    """This call cannot be described by a trace; the message says why."""


def _resolve(src: tuple, leaves: list, produced: list) -> Any:
    kind = src[0]
    if kind == "arg":
        return leaves[src[1]]
    if kind == "out":
        return produced[src[1]][src[2]]
    if kind == "view":
        return _resolve(src[1], leaves, produced).as_strided(*src[2:])
    return src[1]  # "const", "py"


@dataclass(frozen=True)
class Step:
    program: Any                  # runtime.program.Program
    sources: tuple                # per input: ("arg", i) | ("out", step, j) | ("const", tensor)
                                  # | ("view", source, shape, stride, offset): an alias of a source
    reads: tuple                  # ((j, value), ...): Python read output j as this scalar
    writes: tuple = ()            # sources of the real tensors the trailing values are copied into

    def __post_init__(self) -> None:
        # most inputs are weights ("const"): filled in once, not resolved on every call
        object.__setattr__(self, "_template", [s[1] if s[0] == "const" else None for s in self.sources])
        object.__setattr__(self, "_resolved", [(k, s) for k, s in enumerate(self.sources) if s[0] != "const"])
        # the params the program baked, when the trace holds each as a "const" (it always runs
        # with them): a run checks their versions alone, in one pass (148 in a GPT-2 step)
        baked = self.program.baked
        held = all(self.sources[i][0] == "const" and self.sources[i][1] is ref() for i, ref, _ in baked)
        object.__setattr__(self, "_baked", ([self.sources[i][1] for i, _, _ in baked], [v for _, _, v in baked]) if held else None)
        roots = [w[1] for w in self.writes if w[0] == "const"]
        object.__setattr__(self, "_roots", roots if len(roots) == len(self.writes) else None)

    def inputs(self, leaves: list, produced: list) -> list:
        inputs = self._template.copy()
        for k, s in self._resolved:
            inputs[k] = _resolve(s, leaves, produced)
        return inputs

    def valid_for(self, inputs: list) -> bool:
        """The program's `valid_for`: its baked params unchanged."""
        if self._baked is None:
            return self.program.valid_for(inputs)
        tensors, versions = self._baked
        return [t._version for t in tensors] == versions

    def roots(self, leaves: list, produced: list) -> list:
        """The real tensors this step's trailing values are copied into."""
        return self._roots if self._roots is not None else [_resolve(src, leaves, produced) for src in self.writes]


@dataclass(frozen=True)
class Trace:
    steps: tuple
    outputs: tuple                # per output leaf: a source, or ("py", value)
    spec: Any                     # the output's pytree structure
    registrations: int

    def same_as(self, other: "Trace") -> bool:
        def norm(src):
            return ("const", id(src[1])) if src[0] == "const" else src

        def shape(t: Trace) -> list:
            return [(s.program, tuple(map(norm, s.sources)), s.reads, tuple(map(norm, s.writes))) for s in t.steps]
        mine, theirs = shape(self), shape(other)
        return (mine == theirs and self.spec == other.spec and self.registrations == other.registrations
                and [norm(o) for o in self.outputs] == [norm(o) for o in other.outputs])

    def run(self, leaves: list) -> Any:
        """The call's output, or None when a guard fails (then nothing was written)."""
        if self.registrations != _registrations:
            return None
        produced: list[list] = []
        for step in self.steps:
            inputs = step.inputs(leaves, produced)
            if not step.valid_for(inputs):
                return None
            values = step.program(inputs)
            events.STATS.graph_runs += 1
            if events.listeners:
                events.emit(events.GraphRun(step.program.graph, True, 0, step.program.partitions, True, step.program))
            for j, expected in step.reads:
                got = values[j].item()
                if type(got) is not type(expected) or got != expected:
                    return None
            produced.append(values)
        last = self.steps[-1] if self.steps else None
        if last is not None and last.writes:  # only the last step writes, after every guard held
            values = produced[-1]
            copy_back(last.roots(leaves, produced), values[len(values) - len(last.writes):])
        out = [_resolve(o, leaves, produced) for o in self.outputs]
        build = self.__dict__.get("_build")
        if build is None:
            built = pytree.tree_unflatten(out, self.spec)
            object.__setattr__(self, "_build", _builder(self.spec, out, built))
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


class Tracer:
    """Watches one recorded call: the programs it ran and what Python did with their values."""

    def __init__(self) -> None:
        self.runs: list[tuple] = []       # (program, inputs, values, roots it wrote, values[roots])
        self.reads: list[tuple] = []      # (tensor read, value)
        self.why: str | None = None

    def ran(self, program: Any, inputs: list, values: list, roots: list) -> None:
        """`roots`: real tensors the run wrote (a KV cache); the last len(roots) values."""
        n = len(values) - len(roots)
        self.runs.append((program, list(inputs), list(values[:n]), list(roots)))

    def eager(self, op: Any, args: tuple, out: Any) -> None:
        """Python ran `op` outside a graph (a cut, a random op) or read a lazy tensor's data."""
        if op is _SCALAR_READ:
            t = args[0]
            self.reads.append((t._value if hasattr(t, "_slot") else t, out))
        else:
            self.refuse(f"{op if op is not None else 'data read'} ran outside a graph")

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why

    def trace(self, leaves: list, weights: Callable[[torch.Tensor], bool], out: Any) -> Trace:
        if self.why is not None:
            raise Ineligible(self.why)
        where: dict[int, tuple] = {}    # id(tensor) -> source
        storages: dict[int, tuple] = {}  # storage address -> source of a tensor on that storage

        def known(x: torch.Tensor, src: tuple) -> None:
            where[id(x)] = src
            if x.numel():
                storages.setdefault(x.untyped_storage().data_ptr(), src)

        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                known(x, ("arg", i))
            elif type(x) not in SCALARS:  # an object argument (a cache): its tensors, as they are
                where[id(x)] = ("arg", i)
                reached: list = []
                object_state(x, reached)
                for t in reached:
                    where.setdefault(id(t), ("const", t))

        def source(x: Any) -> tuple:
            s = where.get(id(x))
            if s is not None:
                return s
            if not isinstance(x, torch.Tensor):
                if type(x) in SCALARS:
                    return ("py", x)
                raise Ineligible(f"the output holds a {type(x).__name__}")
            if weights(x) or not x.numel():  # an empty tensor has no data to differ
                return ("const", x)
            base = storages.get(x.untyped_storage().data_ptr()) if x.numel() else None
            if base is not None:  # a view Python took of a graph value (logits = mm(...).view(...))
                return ("view", base, tuple(x.shape), x.stride(), x.storage_offset())
            raise Ineligible(f"a graph reads a {x.dtype} tensor of shape {list(x.shape)} made in Python during the call")

        reads: list[list] = [[] for _ in self.runs]
        produced = {id(v): (k, j) for k, run in enumerate(self.runs) for j, v in enumerate(run[2])}
        if any(run[3] for run in self.runs[:-1]):
            raise Ineligible("a graph before the last writes into a real tensor")
        for t, value in self.reads:
            if id(t) not in produced:
                raise Ineligible("Python read a scalar of a tensor that is not a graph output")
            k, j = produced[id(t)]
            reads[k].append((j, value))
        steps = []
        for k, (program, inputs, values, roots) in enumerate(self.runs):
            if torch.is_grad_enabled() and any(x.requires_grad for x in inputs):
                raise Ineligible("autograd records this call")
            writes = tuple(source(r) for r in roots)
            if any(w[0] not in ("arg", "const") for w in writes):
                raise Ineligible("a graph writes into a tensor that is not an argument or reachable from one")
            steps.append(Step(program, tuple(source(x) for x in inputs), tuple(reads[k]), writes))
            for j, v in enumerate(values):
                known(v, ("out", k, j))
        outputs, spec = pytree.tree_flatten(out)
        if not is_plain(spec, outputs=True):
            raise Ineligible(f"the output holds a {spec.type.__name__}, an object Python may update")
        return Trace(tuple(steps), tuple(source(o) for o in outputs), spec, _registrations)


@dataclass
class _Entry:
    trace: Trace
    seen: int = 1


_KEEP = 16  # traces kept per module: a loop that makes a new cache object per call must not keep them all


class Replayer:
    """Per accelerated module: guards → trace; a trace replays once seen twice in a row."""

    def __init__(self, weights: frozenset[int]):
        self.weights = weights
        self.entries: dict[tuple, _Entry] = {}
        self.snapshots: dict[int, Snapshot] = {}  # argument position -> the object last seen there

    def is_weight(self, x: torch.Tensor) -> bool:
        return isinstance(x, torch.nn.Parameter) or id(x) in self.weights

    def replay(self, key: tuple, leaves: list) -> tuple[bool, Any]:
        entry = self.entries.get(key)
        if entry is None or entry.seen < 2:
            return False, None
        out = entry.trace.run(leaves)
        if out is None:
            events.STATS.replay_misses += 1
            events.emit(events.ReplayOutcome("miss"))
            return False, None
        events.STATS.replays += 1
        if events.listeners:
            events.emit(events.ReplayOutcome("replayed"))
        return True, out

    def learn(self, key: tuple, tracer: Tracer, leaves: list, out: Any) -> None:
        try:
            trace = tracer.trace(leaves, self.is_weight, out)
        except Ineligible as e:
            events.STATS.replay_ineligible[str(e)] += 1
            events.emit(events.ReplayOutcome("ineligible", str(e)))
            self.entries.pop(key, None)
            return
        entry = self.entries.get(key)
        if entry is not None and entry.trace.same_as(trace):
            entry.seen += 1
            entry.trace = trace
        else:
            self.entries[key] = _Entry(trace)
            if len(self.entries) > _KEEP:  # the oldest: a trace holds its argument objects' tensors (a KV cache)
                del self.entries[next(iter(self.entries))]

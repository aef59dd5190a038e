"""Compiled programs: a captured graph partitioned over delegates, each partition compiled once,
cached by graph key + guards, run with errors that name the op and the user's source line."""
from __future__ import annotations

import time
import warnings
import weakref
from dataclasses import dataclass
from typing import Callable, Sequence

import torch
import torch.fx as fx

from torchnative import events
from torchnative.grad import no_grad
from torchnative.capture.trie import Node, Signature, build_graph
from torchnative.interface import Artifact, Delegate
from torchnative.delegates.base import in_clean_thread
from torchnative.interface import CompileOnly
from torchnative.delegates.eager import delegate as eager
from torchnative.ir import CapturedGraph
from torchnative.partitioner import EAGER, Partition, Plan, partition
from torchnative.passes import prepare
from torchnative.passes.fuse import fuse
from torchnative.passes.pin import pin
from torchnative import store
from torchnative.runtime import calibration, disk_cache


class CapturedOpError(RuntimeError):
    """An op of a captured graph failed when the graph ran."""


@dataclass
class Step:
    """One partition: which graph values it reads (all, and those passed at run time: a delegate
    bakes params in), which it writes, its loaded runner, and what compiling it cost."""
    delegate: str
    graph: CapturedGraph
    reads: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    run: Callable
    compile_s: float = 0.0
    artifact_bytes: int = 0
    artifact: Artifact | None = None  # kept only for a program built to be saved (a bundle)


def _subgraph(parent: CapturedGraph, part: Partition, values: dict) -> tuple[CapturedGraph, list, list]:
    """The partition as a graph of its own; params it reads become its constants."""
    inside = set(part.nodes)
    reads: list[fx.Node] = []
    for n in part.nodes:
        for u in n.all_input_nodes:
            if u not in inside and u not in reads:
                reads.append(u)
    outputs = [n for n in part.nodes if any(user not in inside for user in n.users)]
    g = fx.Graph()
    env: dict = {}
    roles, constants = [], {}
    for i in reads:
        env[i] = g.placeholder(i.name)
        env[i].meta = dict(i.meta)
        role = parent.input_roles[values["index"][i]] if i in values["index"] else "input"
        roles.append(role)
        if role in ("param", "constant"):
            constants[i.name] = values["tensor"][i]
    for n in part.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
    g.output([env[o] for o in outputs])
    out_roles = ["written_back" if n in values["written_back"] and all(u.op == "output" for u in n.users if u not in inside)
                 else "output" for n in outputs]
    sub = CapturedGraph(fx.GraphModule(torch.nn.Module(), g), roles, out_roles, constants)
    if "samples" in values:
        sub.samples = [[seen[i] for i in reads] for seen in values["samples"]]
    return sub, reads, outputs


def _written_back(graph: CapturedGraph, outputs: list[fx.Node]) -> set[fx.Node]:
    """Values that are outputs only as a state's new value (a KV cache's counter + 1)."""
    regular = {n for n, role in zip(outputs, graph.output_roles) if role != "state_update"}
    return {n for n, role in zip(outputs, graph.output_roles) if role == "state_update"} - regular


def _sample_values(graph: CapturedGraph, inputs: list[torch.Tensor]) -> dict[fx.Node, object]:
    """Every node's value on the inputs the graph was built for (one eager run): calibration
    data for delegates that quantize activations."""
    seen: dict[fx.Node, object] = {}

    class _Keep(fx.Interpreter):
        def run_node(self, n):
            seen[n] = super().run_node(n)
            return seen[n]

    with torch.no_grad():
        _Keep(graph.gm).run(*inputs)
    return seen


def _eager_layout(value: torch.Tensor, shape: torch.Size, want: tuple) -> torch.Tensor:
    """A delegate's output with the strides eager would have given it (`want`, for a value of
    `shape`): later eager ops (view after permute of SDPA's output) and the user can depend on them."""
    stride = value.stride()
    if stride == want or value.numel() <= 1 or 0 in want:
        return value  # an expanded layout (stride 0) cannot be written into: dense values stay dense
    if all(a == b for a, b, n in zip(stride, want, shape) if n != 1):
        return value  # the strides differ only on size-1 dims, which address nothing (a decode step's k/v rows)
    return torch.empty_strided(shape, want, dtype=value.dtype).copy_(value)


def _plan(graph: CapturedGraph, delegates: Sequence[Delegate]) -> Plan:
    """The partitioning, from the disk cache when an earlier process made it."""
    entry = disk_cache.plan_key(graph, delegates) if store.directory() is not None else None
    plan = disk_cache.get_plan(entry, graph.gm.graph) if entry else None
    if plan is None:
        plan = partition(graph.gm.graph, delegates)
        if entry:
            disk_cache.put_plan(entry, plan)
    return plan


def _build(delegate: Delegate, graph: CapturedGraph) -> tuple[Callable | None, str, Artifact]:
    """Load from the disk cache, else compile (and store); a cached artifact that fails to load is
    discarded and compiled again. The runner is None for a compile-only delegate, with its reason."""
    entry = disk_cache.key(delegate, graph) if store.directory() is not None else None
    artifact = disk_cache.get(entry, delegate.name, graph.constants) if entry else None
    if artifact is not None:
        try:
            return (*_load(delegate, artifact), artifact)
        except Exception:
            disk_cache.discard(entry)
    artifact = delegate.compile(fuse(graph, delegate.composites))
    if entry:
        disk_cache.put(entry, artifact)
    return (*_load(delegate, artifact), artifact)


def _load(delegate: Delegate, artifact: Artifact) -> tuple[Callable | None, str]:
    try:
        return delegate.load(artifact), ""
    except CompileOnly as e:
        return None, str(e)


def _fallback(delegate: str, why: str, graph_key: str, n_ops: int) -> None:
    events.STATS.fallbacks[f"{delegate}: {why.splitlines()[0][:200] if why else ''}"] += 1
    events.emit(events.Fallback(delegate, why, graph_key, n_ops))


class Program:
    def __init__(self, graph: CapturedGraph, delegates: Sequence[Delegate], inputs: list[torch.Tensor],
                 quantize: str | None = None, keep_artifacts: bool = False,
                 calibration_sets: Sequence[list[torch.Tensor]] = ()):
        """`keep_artifacts`: each step keeps its delegate's artifact, to be saved in a bundle.
        `calibration_sets`: more sets of inputs, for delegates that calibrate on values."""
        started = time.perf_counter()
        self.captured = graph  # as recorded: what a program for other delegates is built from
        graph, derived = prepare(graph, inputs, quantize)
        self.graph = graph
        self.extra = derived.tensors  # constants the passes computed, appended to every call's inputs
        inputs = inputs + self.extra
        placeholders = [n for n in graph.gm.graph.nodes if n.op == "placeholder"]
        for p, role in zip(placeholders, graph.input_roles):
            p.meta["role"] = role  # delegates' supports() may depend on it (a weight is quantized differently)
        out_node = next(n for n in reversed(graph.gm.graph.nodes) if n.op == "output")
        self.run_fn: Callable = eager.load(eager.compile(graph))
        self.steps = [Step(EAGER, graph, placeholders, placeholders, list(out_node.args[0]), self.run_fn)]
        self._placeholders, self._outputs = placeholders, list(out_node.args[0])
        self.declined: tuple = ()  # (op, delegate, reason) of every node a delegate declined
        baked: set[int] = set()
        if any(d.name != EAGER for d in delegates) and graph.op_nodes():
            plan = _plan(graph, delegates)
            self.declined = _declined(graph, plan.declined)
            if any(p.delegate != EAGER for p in plan.partitions):
                values = {"index": {n: i for i, n in enumerate(placeholders)}, "tensor": dict(zip(placeholders, inputs)),
                          "written_back": _written_back(graph, self._outputs)}
                if any(getattr(d, "calibrates", False) for d in delegates):
                    values["samples"] = [_sample_values(graph, s) for s in (inputs, *(c + self.extra for c in calibration_sets))]
                by_name = {d.name: d for d in delegates}
                parts = plan.partitions
                events.emit(events.Partitioned(graph.key, tuple((p.delegate, len(p.nodes)) for p in parts)))
                self.steps = [self._step(p, by_name, values, (i, len(parts)), keep_artifacts) for i, p in enumerate(parts)]
                self.run_fn = self._run_steps
                baked = {values["index"][n] for s in self.steps if s.delegate != EAGER for n in s.reads if n in values["index"]
                         and graph.input_roles[values["index"][n]] == "param"}
        # params a delegate baked in or a pass computed from: (input index, weakref, version)
        self.baked = [(i, weakref.ref(inputs[i]), inputs[i]._version) for i in sorted(baked | derived.sources)]
        self._count()
        self._index()
        events.emit(events.ProgramBuilt(self, time.perf_counter() - started))

    def stale(self) -> bool:
        """A baked param is gone or has changed since: this program can never run again."""
        return any((t := ref()) is None or t._version != version for _, ref, version in self.baked)

    def valid_for(self, inputs: list[torch.Tensor]) -> bool:
        """Baked params must be the same tensors, unchanged since they were baked."""
        for i, ref, version in self.baked:
            if inputs[i] is not ref() or inputs[i]._version != version:
                return False
        return True

    def changed(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Baked params that are the same tensors as when baked, written since (updated at test time)."""
        return [inputs[i] for i, ref, version in self.baked if inputs[i] is ref() and inputs[i]._version != version]

    def _count(self) -> None:
        """(delegate, ops) per step, kept: every run's GraphRun event carries it."""
        self.partitions = tuple((s.delegate, len(s.graph.op_nodes())) for s in self.steps)

    def _index(self) -> None:
        """Where each step's arguments are in the list of values a run builds (the inputs, then
        each step's outputs in turn), where the program's outputs are, and each delegate output's
        eager layout: a run looks these up by position (a decode step's program has ~200 inputs)."""
        at = {n: k for k, n in enumerate(self._placeholders)}
        for s in self.steps:
            at.update((n, len(at)) for n in s.outputs)
        self._args = [[at[n] for n in s.inputs] for s in self.steps]
        self._results = [at[n] for n in self._outputs]
        self._layouts = [[(n.meta["val"].shape, n.meta["val"].stride()) for n in s.outputs] for s in self.steps]

    def _step(self, part: Partition, delegates: dict, values: dict, position: tuple[int, int], keep: bool) -> Step:
        sub, reads, outputs = _subgraph(self.graph, part, values)
        name = part.delegate
        step = None
        started = time.perf_counter()
        if name != EAGER:
            try:
                runtime_inputs = [n for n, role in zip(reads, sub.input_roles) if role not in ("param", "constant")]
                run, compile_only, artifact = in_clean_thread(_build, delegates[name], sub)
                if run is None:  # built for a device this machine is not: eager runs it here
                    _fallback(name, f"compile-only on this platform: {compile_only}", self.graph.key, len(sub.op_nodes()))
                    run, runtime_inputs = eager.load(eager.compile(sub)), reads
                step = Step(name if compile_only == "" else EAGER, sub, reads, runtime_inputs, outputs, run,
                            time.perf_counter() - started, len(artifact.payload), artifact if keep else None)
            except Exception as e:  # compile failure: this partition runs eagerly, and we say so
                _fallback(name, f"compile failed for {len(sub.op_nodes())} op(s): {type(e).__name__}: {e}",
                          self.graph.key, len(sub.op_nodes()))
        if step is None:
            step = Step(EAGER, sub, reads, reads, outputs, eager.load(eager.compile(sub)))
        events.emit(events.PartitionCompiled(step, self.graph.key, *position))
        return step

    def _run_steps(self, inputs: list[torch.Tensor], timed: bool = False) -> list[torch.Tensor]:
        if len(inputs) != len(self._placeholders):  # values are found by position: a list of another length misplaces all
            raise ValueError(f"a program of {len(self._placeholders) - len(self.extra)} inputs was given "
                             f"{len(inputs) - len(self.extra)}")
        values = list(inputs)
        for i, step in enumerate(self.steps):
            started = time.perf_counter() if timed else 0.0
            try:
                outs = step.run([values[k] for k in self._args[i]])
            except Exception as e:
                if step.delegate == EAGER:
                    raise
                _fallback(step.delegate, f"run failed: {type(e).__name__}: {e}", self.graph.key, len(step.graph.op_nodes()))
                step.delegate, step.inputs, step.run = EAGER, step.reads, eager.load(eager.compile(step.graph))
                self._count()
                self._index()
                outs = step.run([values[k] for k in self._args[i]])
            if step.delegate != EAGER:
                outs = [_eager_layout(v, *layout) for v, layout in zip(outs, self._layouts[i])]
            if timed:
                events.emit(events.PartitionRun(step, self.graph.key, i, started, time.perf_counter() - started))
            values += outs
        return [values[k] for k in self._results]

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.extra:
            inputs = inputs + self.extra
        try:
            with no_grad():
                if events.timing:
                    return self._run_steps(inputs, timed=True)
                return self.run_fn(inputs)
        except Exception as e:
            raise self._locate(inputs, e) from e

    def _locate(self, inputs: list, error: Exception) -> Exception:
        """Re-run node by node to name the op that failed and where the user issued it."""
        failing: list = []

        class _Finder(fx.Interpreter):
            def run_node(self, n):
                try:
                    return super().run_node(n)
                except Exception:
                    failing.append(n)
                    raise

        try:
            with torch.no_grad():
                _Finder(self.graph.gm).run(*inputs)
        except Exception:
            pass
        if not failing:
            return CapturedOpError(f"captured graph failed: {type(error).__name__}: {error}")
        n = failing[0]
        filename, line = n.meta.get("stack") or ("<unknown>", 0)
        return CapturedOpError(
            f"{n.target} failed in a captured graph (issued at {filename}:{line}): "
            f"{type(error).__name__}: {error}")


def _declined(graph: CapturedGraph, declined: dict) -> tuple:
    target = {n.name: str(n.target) for n in graph.op_nodes()}
    return tuple((target.get(name, name), d, why) for name, reasons in declined.items() for d, why in reasons)


_FLOAT_UNDER_AUTOGRAD = "not quantized: autograd records the graph (run under torch.no_grad() to quantize)"


def _under_autograd(inputs: list[torch.Tensor]) -> bool:
    """Autograd records this graph's ops above the door, saving the float weights, and a backward
    runs on those: a quantized forward would get another function's gradients (TENT would adapt
    to a model it does not run). Such graphs stay float, and the user is told once."""
    if not (torch.is_grad_enabled() and any(t.requires_grad for t in inputs)):
        return False
    warnings.warn("torchnative: quantize= leaves the graphs autograd records in float32 (their backward "
                  "would use the float weights); run inference under torch.no_grad() to quantize", stacklevel=2)
    return True


_programs: dict = {}
_runs: dict = {}  # (graph key, delegates) -> runs so far, for compile_after


def program_for(node: Node, sig: Signature, delegates: tuple[Delegate, ...],
                inputs: list[torch.Tensor], compile_after: int = 1, quantize: str | None = None) -> tuple[Program, bool]:
    """The compiled program for this graph key and these guards (baked params' identity and
    version), building it on a miss. Until the graph has run `compile_after` times it runs on
    eager alone: compiling for a delegate costs seconds, and a graph seen once (a new shape at
    every decode step) would never repay it."""
    if calibration.active():  # the graph runs on eager, its inputs kept for the program built later
        calibration.keep((node, sig), inputs)
        delegates = (eager,)
    elif compile_after > 1 and delegates != (eager,):
        seen = _runs[node, sig, delegates] = _runs.get((node, sig, delegates), 0) + 1
        if seen < compile_after:
            delegates = (eager,)
    differentiated = quantize is not None and _under_autograd(inputs)
    if differentiated:
        quantize = None
    key = (node, sig, delegates, quantize)
    candidates = _programs.get(key)
    if candidates is None:
        candidates = _programs[key] = []
    for p in candidates:
        if p.valid_for(inputs):
            events.STATS.cache_hits += 1
            return p, True
    for p in candidates:  # a weight written between two runs of this graph is updated at test time
        for t in p.changed(inputs):
            pin(t, f"written between two runs of graph {p.graph.key[:12]} (updated at test time): "
                   f"now an input of every program, never baked, folded or quantized")
    events.STATS.cache_misses += 1
    if differentiated:
        events.STATS.quantized[_FLOAT_UNDER_AUTOGRAD] += 1
    candidates[:] = [p for p in candidates if not p.stale()]
    p = Program(build_graph(node, sig), delegates, inputs, quantize, calibration_sets=calibration.sets((node, sig)))
    candidates.append(p)
    events.STATS.graphs_built += 1
    return p, False


def clear_caches() -> None:
    """Forget every compiled program, recorded trie path and inferred shape (a cold start)."""
    from torchnative.capture import meta, trie

    _programs.clear()
    _runs.clear()
    calibration.forget()
    trie.ROOT.children.clear()
    meta._cache.clear()

"""Compiled methods → the files of a bundle (DESIGN.md §7). A method is its replay trace written
out (bundle/manifest.py): every graph value gets a global name ("<method>.g<program>.<node>");
per program, where its inputs come from (an argument, an earlier program's output, a weight, a
state), its partitions in execution order with the values each reads and writes, the scalars
Python read, and which states its last outputs are the new values of. Weights are stored once,
whichever methods read them."""
from __future__ import annotations

import io
import json
import time
from collections import defaultdict
from pathlib import Path
from typing import Callable

import torch
import torch.fx as fx

from torchnative import remote
from torchnative.bundle import dynamic
from torchnative.bundle import manifest as m
from torchnative.bundle.build import CompiledBuckets, Compiled, CompiledMethod
from torchnative.bundle.format import OLDEST, SCHEMA, SIZED, WEIGHTS, BundleError, sha256, write
from torchnative.delegates import REGISTRY
from torchnative.delegates.eager import delegate as eager
from torchnative.ir import CapturedGraph, is_weight
from torchnative.passes import pin
from torchnative.passes.fuse import fuse
from torchnative.passes.state import SLICE_UPDATE
from torchnative.replay import trace
from torchnative.build.program import Program, Step
from torchnative.sizes import SIZES, dense_order
from torchnative.toolchain import versions

def _dtype(t: torch.Tensor) -> str:
    return str(t.dtype).removeprefix("torch.")


def _spec(t: torch.Tensor) -> dict:
    return {"dtype": _dtype(t), "shape": list(t.shape)}


def _range(t: torch.Tensor) -> list[int] | None:
    """The example's value range of an integer input (token ids, a mask): `run --input x=random`
    draws from it."""
    if t.dtype.is_floating_point or t.dtype.is_complex or t.numel() == 0:
        return None
    return [int(t.min()), int(t.max())]


def _exported(graph: CapturedGraph) -> bytes:
    """An eager partition as a serialized ExportedProgram taking every value it reads (weights
    included: they are stored once, in the safetensors file)."""
    plain = CapturedGraph(graph.gm, graph.input_roles, graph.output_roles)
    if not graph.outputs():  # only writes a state in place; torch.export cannot save a program of no outputs
        plain = graph.copy()
        out = plain.output_node()
        out.args = ([n for n in plain.gm.graph.nodes if n.target is SLICE_UPDATE],)
        plain.gm.recompile()
    buffer = io.BytesIO()
    torch.export.save(plain.to_exported_program(), buffer)
    return buffer.getvalue()


class _Writer:
    def __init__(self, compiled: Compiled):
        self.compiled = compiled
        self.files: dict[str, bytes] = {}
        self.written: dict[str, str] = {}  # sha256 -> the file holding that payload
        self.weights: dict[str, torch.Tensor] = {}
        self.weight_ids: dict[int, str] = {}
        self.originals: dict[str, torch.Tensor] = {}  # name -> the model's tensor (pinned or not)
        self.method = ""  # the method being written
        self.inputs: list[str] = []  # its argument names
        self.values: list[list[str]] = []  # per program of it already written: its output values' names
        self.symbols: list[dict] = []  # per program of it: its symbols as (coef, const) of n (Method.symbols)

    def weight(self, t: torch.Tensor, fallback: str) -> str:
        name = self.weight_ids.get(id(t))
        if name is None:
            name = self.compiled.weight_names.get(id(t), fallback)
            self.weight_ids[id(t)] = name
            self.originals[name] = t
            self.weights[name] = t.detach().contiguous().clone()
        return name

    def source(self, src: tuple, k: int, i: int) -> m.Source:
        """A trace source (replay/trace.py) as the manifest says it."""
        kind = src[0]
        if kind == "arg":
            return m.Source(arg=self.inputs[src[1]])
        if kind == "out":
            return m.Source(value=self.values[src[1]][src[2]])
        if kind == "view":
            return m.Source(view=self.source(src[1], k, i), shape=list(src[2]), stride=list(src[3]), offset=src[4])
        if kind == "const" and id(src[1]) in self.compiled.states:
            return m.Source(state=self.compiled.states[id(src[1])][0])
        if kind == "const":
            return m.Source(weight=self.weight(src[1], f"constants.{self.method}.g{k}.in{i}"))
        if kind == "py":
            return m.Source(py=src[1])
        raise BundleError(f"an input of graph {k} comes from {kind!r}, which a bundle cannot hold")

    def partition(self, k: int, j: int, step: Step, name: Callable[[fx.Node], str]) -> m.PartitionEntry:
        """A partition's file and how to run it. A compile-only delegate's partition (Core ML off
        macOS) ran on eager when built: the bundle holds its artifact, for the device, and eager's
        program as the `fallback` that runs where the delegate does not."""
        built = step.artifact  # None on an eager step, unless a compile-only delegate made it
        delegate = built.delegate if built is not None else eager.name
        constants: dict[str, str] = {}  # the artifact's name for a weight -> the bundle's
        if built is None:
            payload, meta, inputs = _exported(step.graph), {}, step.inputs
        else:
            payload, meta = built.payload, built.meta
            inputs = [n for n, r in zip(step.reads, step.graph.input_roles) if not is_weight(r)]
            constants = {local: self.weight(t, f"constants.{self.method}.g{k}.p{j}.{local}") for local, t in built.constants.items()}
            if built.live is not None:
                raise BundleError(f"delegate {delegate!r} runs a Python object of this process, not its artifact "
                                  f"alone; it cannot be saved in a bundle yet: choose other --targets (ort, xnnpack)")
        fallback = None
        if built is not None and step.delegate == eager.name:
            fallback = m.Fallback(**self.file(f"g{k}_p{j}", eager.name, _exported(step.graph)),
                                  inputs=[name(n) for n in step.reads])
        verdict = step.verdict
        return m.PartitionEntry(delegate=delegate, **self.file(f"g{k}_p{j}", delegate, payload), meta=meta,
                           constants=constants, ops=len(step.graph.op_nodes()), op_counts=dict(step.graph.op_counts()),
                           inputs=[name(n) for n in inputs],
                           outputs=[m.PartitionOutput(value=name(n), **self.layout(k, n)) for n in step.outputs],
                           compile_s=round(step.compile_s, 3), fallback=fallback,
                           gap=None if verdict is None else verdict.gap if verdict.gap < float("inf") else "inf",
                           tolerance=None if verdict is None else f"{verdict.tolerance.kind} {verdict.tolerance.bound:g}"
                                                                  + ("" if verdict.ok else ", declined: saved on eager"))

    def layout(self, k: int, n: fx.Node) -> dict:
        """A graph value's dtype, shape and strides; in a method whose sizes follow n, each that
        follows it as an expression in n, and a dense value's layout as the order of its dims."""
        val = n.meta["val"]
        rules = n.meta.get(SIZES)
        if not rules:
            return {**_spec(val), "stride": list(val.stride())}

        def size(kind: str, d: int, value: int) -> int | str:
            rule = rules.get((kind, d))
            if rule is None:
                return value
            coef, const = self.symbols[k][rule.symbol]
            return dynamic.expr(rule.coef * coef, rule.coef * const + rule.const)

        shape = [size("shape", d, v) for d, v in enumerate(val.shape)]
        order = dense_order(tuple(val.shape), val.stride())
        layout = {"order": list(order)} if order is not None else \
            {"stride": [size("stride", d, v) for d, v in enumerate(val.stride())]}
        return {"dtype": _dtype(val), "shape": shape, **layout}

    def file(self, stem: str, delegate: str, payload: bytes) -> dict:
        digest = sha256(payload)
        path = self.written.get(digest)  # an artifact several methods' partitions run (_shared_assets)
        if path is None:
            path = self.written[digest] = f"partitions/{self.method}_{stem}_{delegate}.{REGISTRY[delegate].extension}"
            self.files[path] = payload
        return {"artifact": path, "bytes": len(payload), "sha256": digest}

    def program(self, k: int, call: trace.GraphCall) -> m.ProgramEntry:
        program: Program = call.program
        name = lambda n: f"{self.method}.g{k}.{n.name}"  # noqa: E731
        placeholders = program.graph.placeholders()
        out_node = program.graph.output_node()
        # a value only delegates read is compiled into their artifacts: the bundle need not carry it
        needed = {n for s in program.steps for n in s.inputs} | set(out_node.args[0])
        sources = [*call.sources, *(("const", t) for t in program.extra)]
        inputs = []
        for i, (n, src) in enumerate(zip(placeholders, sources)):
            if n in needed:
                source = self.source(src, k, i)
                # a state's shape is what the graph was compiled for: a loader checks the state spec against it
                inputs.append(m.ProgramInput(name(n), source, **(_spec(n.meta["val"]) if source.state else {})))
        outputs = [name(n) for n in out_node.args[0]]
        self.values.append(outputs)
        checks = []
        for j, expected in call.reads:
            node = out_node.args[0][j]
            filename, line = node.meta.get("stack") or ("<unknown>", 0)
            checks.append(m.Check(outputs[j], expected, str(node.target), f"{filename}:{line}"))
        writes = [self.source(w, k, -1) for w in call.writes]
        if any(w.state is None for w in writes):
            raise BundleError(f"graph {k} of {self.method} writes into a tensor that is not a state of the bundle")
        return m.ProgramEntry(program.graph.key, inputs, [self.partition(k, j, s, name) for j, s in enumerate(program.steps)],
                         outputs, checks, [w.state for w in writes])

    def method_record(self, name: str, method: CompiledMethod | CompiledBuckets) -> m.MethodEntry:
        if isinstance(method, CompiledBuckets):
            return m.MethodEntry(_inputs(method), [m.Output(n, slice=s) for n, s in zip(method.output_names, method.slices)],
                            size=method.size, buckets=[m.Bucket(size, padded, b) for size, padded, b in method.buckets])
        self.method, self.inputs, self.values, self.symbols = name, list(method.inputs), [], method.symbols
        programs = [self.program(k, s) for k, s in enumerate(method.trace.calls)]
        outputs = [m.Output(n, self.source(s, -1, i)) for i, (n, s) in enumerate(zip(method.output_names, method.trace.outputs))]
        return m.MethodEntry(_inputs(method), outputs, programs, size=method.size or None)

    def files_and_manifest(self, model: str) -> dict[str, bytes]:
        from safetensors.torch import save

        methods = {name: self.method_record(name, method) for name, method in self.compiled.methods.items()}
        self.files[WEIGHTS] = save(self.weights)
        delegates = {p.delegate for method in methods.values() for g in method.programs for p in g.partitions}
        manifest = m.Manifest(
            # written as the oldest schema whose readers run it
            schema=SCHEMA if any(method.buckets for method in methods.values()) else
            SIZED if any(method.size for method in methods.values()) else OLDEST,
            model=model, created=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            toolchain=versions(p for d in delegates for p in REGISTRY[d].toolchain),
            weights=m.Weights(WEIGHTS, len(self.files[WEIGHTS]), sha256(self.files[WEIGHTS]),
                              {n: _spec(t) for n, t in self.weights.items()}),
            pinned=[m.Pinned(n, pin.reason(t)) for n, t in self.originals.items() if pin.is_pinned(t)],
            state=[m.State(n, **_spec(t), init="zeros") for n, t in self.compiled.states.values()],
            methods=methods, generate=self.compiled.generation)
        self.files["manifest.json"] = json.dumps(manifest.to_json(), indent=1).encode()
        return self.files


def _inputs(method: CompiledMethod | CompiledBuckets) -> list[m.Input]:
    """A method's inputs as the manifest describes them: a dim that follows n as "n"."""
    sized = {tuple(d) for d in method.size["dims"]} if method.size else set()
    return [m.Input(n, _dtype(t), ["n" if (n, d) in sized else size for d, size in enumerate(t.shape)], _range(t))
            for n, t in method.inputs.items()]


def bundle_files(compiled: Compiled, model: str) -> dict[str, bytes]:
    """The bundle's files by name; `model` describes where it came from (for the manifest)."""
    _shared_assets(compiled)
    return _Writer(compiled).files_and_manifest(model)


def _shared_assets(compiled: Compiled) -> None:
    """Partitions at the same place in each method (graph k, partition j) whose delegate makes one
    artifact of several functions (Core AI: prefill and decode functions over the same weights, a
    device's one asset) become that artifact, each running its own function (in place)."""
    groups: dict[tuple, dict[str, Step]] = defaultdict(dict)
    for name, method in compiled.methods.items():
        if isinstance(method, CompiledBuckets):
            continue
        for k, call in enumerate(method.trace.calls):
            for j, step in enumerate(call.program.steps):
                if step.artifact is not None and step.delegate == step.artifact.delegate \
                        and hasattr(REGISTRY[step.delegate], "compile_functions"):
                    groups[step.delegate, k, j][name] = step
    for (name, _, _), steps in groups.items():
        if len(steps) > 1:
            delegate = REGISTRY[name]
            built = delegate.compile_functions({method: fuse(s.graph, delegate.composites) for method, s in steps.items()})
            for method, step in steps.items():
                step.artifact = built[method]


def save(compiled: Compiled, path: str | Path, model: str,
         on_file: Callable[[str, int], None] = lambda name, size: None) -> tuple[Path | str, dict[str, bytes]]:
    """Write the bundle at `path` (a directory, or a zip file if it ends in .zip; here or at an
    fsspec URL); returns the path and the files written."""
    files = bundle_files(compiled, model)
    path = path if remote.is_url(path) else Path(path)
    write(path, files, on_file)
    return path, files

"""Apple Neural Engine (and Core ML's GPU/CPU) through coremltools: a Core ATen subgraph →
ExportedProgram (decomposed to Core ATen: coremltools rejects a raw export) → an ML program for
iOS 18 / macOS 15, fp16 by default (the precision the Neural Engine computes in), optionally with
compressed weights → the .mlpackage, zipped, is the artifact.

Core ML predicts on macOS and iOS only. Elsewhere the delegate is compile-only: partitions are
converted and validated (a bundle ships them), and run on eager with that reason. Which nodes
Core ML takes is found by converting each kind of node alone (delegates/probe.py).
"""
from __future__ import annotations

import functools
import importlib.util
import io
import operator
import platform
import tempfile
import zipfile
from pathlib import Path

import numpy as np
import torch
import torch.fx as fx

from torchnative.delegates.base import state_or_aten, tensors
from torchnative.interface import Artifact, Availability, CompileOnly, Runner, Support
from torchnative.delegates.probe import Probe
from torchnative.delegates.onnx_export import slice_write
from torchnative.ir import CapturedGraph, is_weight
from torchnative.quiet import quiet
from torchnative.passes.attention import zero_masked_rows
from torchnative.passes.state import SLICE_UPDATE, state_of, written_states

aten = torch.ops.aten
_INDEX_PUT = aten.index_put.default
_HINT = "pip install coremltools==9.0"
_ELSEWHERE = "Core ML runs models on macOS and iOS only"
# which of Apple's two to choose, said by both delegates' availability()
CHOOSE = "coreml for devices on iOS 18 / macOS 15 up to 26 (Core ML); coreai for iOS / macOS 27 and later (Core AI)"
PRECISIONS = ("float16", "float32")
COMPRESSIONS = (None, "int8", "int4", "palettize4")
# dtypes an ML program's tensors can hold (int64 and bool inputs are narrowed by the converter)
_DTYPES = {torch.float32, torch.float16, torch.int32, torch.int64, torch.bool}


@functools.cache
def _ct():
    """coremltools, imported without its notes on untested torch/scikit-learn versions and on the
    macOS-only libraries it cannot load here."""
    with quiet():
        import coremltools

        import coremltools.optimize.coreml  # noqa: F401 -- for _compress
    return coremltools


def _compress(mlmodel, how: str):
    cto = _ct().optimize.coreml
    if how == "int8":
        config = cto.OptimizationConfig(global_config=cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int8",
                                                                                  granularity="per_channel"))
        return cto.linear_quantize_weights(mlmodel, config)
    if how == "int4":
        config = cto.OptimizationConfig(global_config=cto.OpLinearQuantizerConfig(mode="linear_symmetric", dtype="int4",
                                                                                  granularity="per_block", block_size=32))
        return cto.linear_quantize_weights(mlmodel, config)
    if how == "palettize4":
        config = cto.OptimizationConfig(global_config=cto.OpPalettizerConfig(mode="kmeans", nbits=4))
        return cto.palettize_weights(mlmodel, config)
    raise ValueError(f"unknown Core ML weight compression {how!r}; choose one of {COMPRESSIONS}")


def zip_folder(folder: Path) -> bytes:
    """A package directory (.mlpackage, .aimodel) as deterministic zip bytes (sorted names, fixed times). Empty
    directories are kept: the package's manifest names them (a weightless model's weights/)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_STORED) as z:
        for path in sorted(folder.rglob("*")):
            name = str(path.relative_to(folder.parent)) + ("/" if path.is_dir() else "")
            info = zipfile.ZipInfo(name, date_time=(1980, 1, 1, 0, 0, 0))
            z.writestr(info, b"" if path.is_dir() else path.read_bytes())
    return out.getvalue()


def unpack(payload: bytes, into: Path, suffix: str = ".mlpackage") -> Path:
    """The artifact's package (a directory named *suffix), unzipped under `into`."""
    with zipfile.ZipFile(io.BytesIO(payload)) as z:
        names = z.namelist()
        unsafe = [n for n in names if n.startswith("/") or ".." in Path(n).parts]
        if unsafe:
            raise ValueError(f"an artifact names files outside its {suffix} package: {unsafe[:3]}")
        z.extractall(into)
        top = {Path(n).parts[0] for n in names}
    if len(top) != 1 or not next(iter(top)).endswith(suffix):
        raise ValueError(f"the artifact holds one {suffix} package, this one holds {sorted(top)}")
    return into / top.pop()


def describe(payload: bytes) -> dict:
    """What can be checked without running the model (anywhere): the package's spec loads, its ML
    program parses back with every weight it references, its inputs and outputs, its operations
    by type."""
    ct = _ct()
    from coremltools.converters.mil.frontend.milproto.load import load as parse

    with tempfile.TemporaryDirectory() as tmp, quiet():
        package = unpack(payload, Path(tmp))
        spec = ct.utils.load_spec(str(package))
        weights = next(package.rglob("weights"), package)
        parse(spec, spec.specificationVersion, file_weights_dir=str(weights))  # every op and weight blob reads back
    ops: dict[str, int] = {}

    def count(block):
        for op in block.operations:
            ops[op.type] = ops.get(op.type, 0) + 1
            for b in op.blocks:
                count(b)

    for function in spec.mlProgram.functions.values():
        for block in function.block_specializations.values():
            count(block)
    return {"spec_version": spec.specificationVersion,
            "inputs": [i.name for i in spec.description.input], "outputs": [o.name for o in spec.description.output],
            "states": [{"name": st.name, "shape": list(st.type.stateType.arrayType.shape)} for st in spec.description.state],
            "ops": ops}


class CoreML:
    name = "coreml"
    external_weights = False
    writes_in_place = True  # a state update writes a Core ML state (StateType, iOS 18): mutable on device
    composites: frozenset[str] = frozenset()
    toolchain = ("coremltools",)
    extension = "mlpackage.zip"
    calibrates = False
    dynamic = False  # static shapes: the partitioner leaves nodes whose sizes vary to eager

    def __init__(self, precision: str = "float16", compress: str | None = None):
        if precision not in PRECISIONS:
            raise ValueError(f"unknown Core ML precision {precision!r}; choose one of {PRECISIONS}")
        if compress not in COMPRESSIONS:
            raise ValueError(f"unknown Core ML weight compression {compress!r}; choose one of {COMPRESSIONS}")
        self.precision, self.compress = precision, compress
        self._probe = Probe(self, "coreml-ops", "Core ML", self._convert)

    def available(self) -> Availability:
        if importlib.util.find_spec("coremltools") is None:
            return Availability("unavailable", "coremltools is not installed", _HINT)
        if platform.system() != "Darwin":
            return Availability("compile-only", f"{_ELSEWHERE}; {CHOOSE}")
        return Availability("executes", CHOOSE)

    def supports(self, node: fx.Node) -> Support:
        verdict = state_or_aten(node, "Core ML state")
        if verdict is not None:
            return verdict
        if _op_name(node.target) not in _registered():
            return Support(False, f"coremltools has no translation of {node.target}")
        if any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users):
            return Support(False, f"coremltools translates the first result of {node.target} only")
        for t in tensors(node):
            if t.dtype not in _DTYPES:
                return Support(False, f"{t.dtype} tensors: an ML program holds float16/32, int32 and bool")
        return self._probe(node)

    def compile(self, graph: CapturedGraph) -> Artifact:
        mlmodel = self._convert(graph)
        with tempfile.TemporaryDirectory() as tmp, quiet():
            mlmodel.save(str(Path(tmp) / "model.mlpackage"))
            payload = zip_folder(Path(tmp) / "model.mlpackage")
        runtime = [n.name for n, role in zip(graph.placeholders(), graph.input_roles) if not is_weight(role)]
        states = written_states(graph)
        return Artifact(self.name, payload, {"n_outputs": len(graph.output_roles), "precision": self.precision,
                                             "compress": self.compress, **describe(payload),
                                             # runtime inputs that are states, and outputs that are a state
                                             "state_inputs": [[n, runtime.index(n)] for n in states],
                                             "state_outputs": [[k, runtime.index(state_of(o))] for k, o in
                                                               enumerate(graph.outputs()) if state_of(o) in states]})

    def load(self, artifact: Artifact) -> Runner:
        if platform.system() != "Darwin":
            raise CompileOnly(_ELSEWHERE)
        ct = _ct()
        folder = tempfile.mkdtemp(prefix="torchnative-coreml-")
        model = ct.models.MLModel(str(unpack(artifact.payload, Path(folder))))
        inputs, outputs = artifact.meta["inputs"], artifact.meta["outputs"]
        named = artifact.meta.get("state_inputs", [])
        held = {k for _, k in named}
        placed = dict(artifact.meta.get("state_outputs", []))

        def runner(values: list[torch.Tensor], _keep=folder) -> list[torch.Tensor]:
            # The caller's tensors stay the states' truth: written into a Core ML state before the
            # prediction and read back after (an app keeps the MLState across calls instead)
            feed = {n: t.detach().numpy() for n, t in zip(inputs, [t for k, t in enumerate(values) if k not in held])}
            if not named:
                got = model.predict(feed)
            else:
                state = model.make_state()
                for name, k in named:
                    state.write_state(name, values[k].detach().numpy())
                got = model.predict(feed, state=state)
                for name, k in named:
                    values[k].copy_(torch.from_numpy(np.asarray(state.read_state(name))))
            produced = iter(torch.from_numpy(np.asarray(got[n])) for n in outputs)
            return [values[placed[k]] if k in placed else next(produced) for k in range(len(outputs) + len(placed))]

        return runner

    def _convert(self, graph: CapturedGraph):
        """The graph as a Core ML model (coremltools' MLModel, not loaded: it cannot be here)."""
        ct = _ct()

        precision = ct.precision.FLOAT16 if self.precision == "float16" else ct.precision.FLOAT32
        with quiet():
            # a state the graph writes is a mutable buffer of the export: coremltools makes it a state
            states = frozenset(written_states(graph))
            exported = _indexed_in_full(graph).to_exported_program(dense=True, states=states).run_decompositions({})
            pipeline = ct.PassPipeline.DEFAULT
            if states:
                # its rewrite of a state write that nothing reads after (a KV cache's, read through
                # the functional twin) fails inserting before an op it removed (coremltools 9.0)
                pipeline.remove_passes(["common::canonicalize_inplace_pattern"])
            mlmodel = ct.convert(exported, convert_to="mlprogram", minimum_deployment_target=ct.target.iOS18,
                                 compute_precision=precision, skip_model_load=True, pass_pipeline=pipeline)
            return _compress(mlmodel, self.compress) if self.compress else mlmodel


def _indexed_in_full(graph: CapturedGraph) -> CapturedGraph:
    """The graph with each write at several positions of one dim after whole dims (a prefill's
    `cache[:, :, positions] = kv`) indexed in every dim up to that one: coremltools 9.0 translates
    a whole-dim index (None) as a one-position slice assignment, which fails to convert with more
    positions; with all leading dims indexed it is a scatter."""
    g = fx.Graph()
    env: dict = {}
    for n in graph.gm.graph.nodes:
        env[n] = g.node_copy(n, env.__getitem__)
        if n.target not in (SLICE_UPDATE, _INDEX_PUT) or not slice_write(n):
            continue
        index = list(n.args[1])
        dim = next(d for d, i in enumerate(index) if i is not None)
        positions = index[dim].meta["val"].shape[0]
        if positions == 1 or dim == 0:
            continue
        shape = list(n.args[0].meta["val"].shape[:dim]) + [positions]
        with g.inserting_before(env[n]):
            full = [g.call_function(aten.expand.default, (g.call_function(aten.view.default, (
                g.call_function(aten.arange.default, (size,), {"dtype": torch.int64}),
                [size if k == d else 1 for k in range(dim + 1)])), shape)) for d, size in enumerate(shape[:-1])]
            full.append(g.call_function(aten.expand.default, (env[index[dim]], shape)))
        env[n].args = (env[n].args[0], full, *env[n].args[2:])
    zero_masked_rows(g)  # Core ML's attention is a plain softmax: NaN where a mask hides every key
    return CapturedGraph(fx.GraphModule(torch.nn.Module(), g), graph.input_roles, graph.output_roles,
                         graph.constants, writes=graph.writes)


def _op_name(op: torch._ops.OpOverload) -> str:
    return op._schema.name.split("::")[1]


@functools.cache
def _registered() -> frozenset[str]:
    """Op names coremltools' torch frontend translates (by name, overloads folded)."""
    _ct()
    from coremltools.converters.mil.frontend.torch.torch_op_registry import _TORCH_OPS_REGISTRY
    return frozenset(n.split(".")[0] for n in _TORCH_OPS_REGISTRY.name_to_func_mapping)


delegate = CoreML()

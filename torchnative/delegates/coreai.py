"""Apple's Core AI (the successor of Core ML's model format, macOS/iOS 27) through coreai-torch:
a Core ATen subgraph → ExportedProgram decomposed with Core AI's table → a Core AI program → an
`.aimodel` asset directory, zipped, is the artifact. Graph inputs a partition writes in place (a
KV cache) are the program's *states*, updated in place by the runtime.

coreai-core ships a reference runtime that executes assets on Linux, so the delegate executes
here: slowly (an interpreter, ~10x torch on compute-heavy work), on no chosen unit (CPU, GPU and
Neural Engine are macOS 27+). Its results are what an Apple device computes up to the units'
arithmetic, which is why it is worth running here: a partition is checked against eager.
Which nodes Core AI takes is found by converting each kind of node alone (delegates/probe.py).
"""
from __future__ import annotations

import asyncio
import functools
import importlib.util
import operator
import tempfile
import threading
from pathlib import Path

import numpy as np
import torch
import torch.fx as fx

from torchnative.delegates import coreai_composites
from torchnative.delegates.base import state_or_aten, tensors
from torchnative.delegates.coreml import CHOOSE, unpack, zip_folder
from torchnative.delegates.probe import Probe
from torchnative.interface import Artifact, Availability, Runner, Support
from torchnative.ir import CapturedGraph, is_weight
from torchnative.passes.attention import as_sdpa, zero_masked_rows
from torchnative.passes.state import state_of, whole_writes, written_states
from torchnative.quiet import native_notes_dropped, quiet

_HINT = "pip install coreai-torch==0.4.3 coreai-core==1.0.0b3"
_HERE = "the reference runtime of coreai-core (an interpreter: slow; CPU/GPU/Neural Engine choice is macOS 27+)"
# dtypes a Core AI program's tensors hold here; int64 arrives as int32 (the runtime's integers);
# int8: quantized weights' integers
_DTYPES = {torch.float32, torch.float16, torch.int32, torch.int64, torch.int8, torch.bool}
# a native assertion in the converter (SIGABRT, not an exception): never asked, not even alone
_ABORTS_ON_0D = {torch.ops.aten.mean.default, torch.ops.aten.sum.default, torch.ops.aten.mean.dim,
                 torch.ops.aten.sum.dim_IntList}


@functools.cache
def _converter():
    with quiet():  # its notes on import (deprecated torch APIs)
        import coreai_torch
    return coreai_torch


def _remainder(x: torch.Tensor, n) -> torch.Tensor:
    return x - torch.div(x, n, rounding_mode="floor") * n


# ops coreai-torch 0.4.3 does not convert, written with ones it does (a ring buffer's slot is a remainder)
_DECOMPOSITIONS = {torch.ops.aten.remainder.Scalar: _remainder, torch.ops.aten.remainder.Tensor: _remainder}


class CoreAI:
    name = "coreai"
    external_weights = False
    writes_in_place = True  # a state update writes a Core AI state, in place on device
    # as Core AI's composite ops and compressed weights (delegates/coreai_composites.py)
    composites = frozenset({"rms_norm", "rope", "quantized_mm", "quantized_addmm", "delta_rule"})
    toolchain = ("coreai-torch", "coreai-core")
    extension = "aimodel.zip"
    calibrates = False
    # sizes that vary are `?` dims of the Core AI function (the export's dynamic_shapes). The
    # composites' bodies slice to a dim's end whatever its size: a slice to the static size a `?`
    # dim does not have made the reference runtime abort the process (a fatal error in its native
    # code, nothing to catch)
    dynamic = True

    def __init__(self):
        self._probe = Probe(self, "coreai-ops", "Core AI", lambda graph: self._convert({"main": graph}))

    def available(self) -> Availability:
        if importlib.util.find_spec("coreai_torch") is None or importlib.util.find_spec("coreai") is None:
            return Availability("unavailable", "coreai-torch and coreai-core are not installed", _HINT)
        return Availability("executes", f"runs on {_HERE}; {CHOOSE}")

    def supports(self, node: fx.Node) -> Support:
        verdict = state_or_aten(node, "Core AI state")
        if verdict is not None:
            return verdict
        if any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users):
            return Support(False, f"coreai-torch converts the first result of {node.target} only")
        first = node.args[0].meta.get("val") if node.args and isinstance(node.args[0], fx.Node) else None
        if node.target in _ABORTS_ON_0D and isinstance(first, torch.Tensor) and first.dim() == 0:
            return Support(False, f"coreai-torch 0.4.3 aborts the process converting {node.target} of a 0-d tensor")
        for t in tensors(node):
            if t.dtype not in _DTYPES:
                return Support(False, f"{t.dtype} tensors: a Core AI program holds float16/32, int8/32/64 and bool here")
        return self._probe(node)

    def _convert(self, graphs: dict[str, CapturedGraph]):
        """The graphs as one Core AI program (coreai's AIProgram), a function per name."""
        ct = _converter()
        with quiet():
            converter = ct.TorchConverter()
            coreai_composites.register(converter)
            for name, graph in graphs.items():
                graph = coreai_composites.palettized(graph)  # palettized weights as lookups
                states = _states(graph)
                inputs = [n.name for n, role in zip(graph.placeholders(), graph.input_roles)
                          if not is_weight(role) and n.name not in states]
                outputs = [f"out_{k}" for k, o in enumerate(graph.outputs()) if state_of(o) not in states]
                exported = graph.to_exported_program(dense=True, states=frozenset(states))
                # attention as the op coreai-torch makes Core AI's composite of; its rows that see no key 0, as in eager
                as_sdpa(zero_masked_rows(exported.graph))
                exported.graph_module.recompile()
                exported = exported.run_decompositions({**ct.get_decomp_table(), **_DECOMPOSITIONS})
                converter.add_exported_program(exported, input_names=inputs, output_names=outputs, state_names=states,
                                               entrypoint_name=name)
            return converter.to_coreai()

    def compile(self, graph: CapturedGraph) -> Artifact:
        return self.compile_functions({"main": graph})["main"]

    def compile_functions(self, graphs: dict[str, CapturedGraph]) -> dict[str, Artifact]:
        """One asset holding a function per graph (a generating bundle's prefill and decode: their
        weights once), and each function's artifact: the asset, and how to call that function."""
        from coreai.authoring import AIModelAsset

        graphs = {name: whole_writes(g) for name, g in graphs.items()}  # fast weights as states
        program = self._convert(graphs)
        with tempfile.TemporaryDirectory() as tmp, quiet():
            program.save_asset(Path(tmp) / "model.aimodel")
            payload = zip_folder(Path(tmp) / "model.aimodel")
            # the OS release the asset needs (its compatibility version: 27.0 for 1.0.0b3's programs)
            target = AIModelAsset.load(Path(tmp) / "model.aimodel").summary()._compatibility_version
        return {name: Artifact(self.name, payload, {"os": f"macOS/iOS {target}", "function": name, **_calling(graph)})
                for name, graph in graphs.items()}

    def load(self, artifact: Artifact) -> Runner:
        from coreai.authoring import AIModelAsset
        from coreai.runtime import NDArray

        folder = tempfile.mkdtemp(prefix="torchnative-coreai-")
        asset = AIModelAsset.load(unpack(artifact.payload, Path(folder), ".aimodel"))
        loop, lock = asyncio.new_event_loop(), threading.Lock()
        executable = asset.executable()
        with quiet(), native_notes_dropped("ODIE "):  # the runtime's note on each function it loads
            model = loop.run_until_complete(executable.__aenter__())
            function = model.load_function(artifact.meta.get("function", "main"))
        names, states, outputs = artifact.meta["inputs"], artifact.meta["states"], artifact.meta["outputs"]
        held = {k for _, k in states}
        produced_names = function.desc.output_names

        def runner(values: list[torch.Tensor], _keep=(folder, executable)) -> list[torch.Tensor]:
            # The caller's tensors stay the states' truth: given to the function and copied back
            # after (an app keeps its state arrays across calls instead)
            feed = {n: NDArray(_runtime_array(t)) for n, t in zip(names, [t for k, t in enumerate(values) if k not in held])}
            state = {n: NDArray(_runtime_array(values[k])) for n, k in states}
            with lock:
                got = loop.run_until_complete(function(feed, state=state))
            with torch.no_grad():  # a fast weight may be a parameter: the write is the state's, not autograd's
                for n, k in states:
                    values[k].copy_(torch.from_numpy(np.asarray(state[n].numpy())))
            produced = iter(got[n] for n in produced_names)
            return [values[o[0]] if isinstance(o, list) else
                    torch.from_numpy(np.array(next(produced).numpy())).to(getattr(torch, o)) for o in outputs]

        return runner


def _calling(graph: CapturedGraph) -> dict:
    """How a runner calls the graph's function: its inputs and states by name, and its outputs."""
    states = _states(graph)
    runtime = [n.name for n, role in zip(graph.placeholders(), graph.input_roles) if not is_weight(role)]
    return {"inputs": [n for n in runtime if n not in states], "states": [[n, runtime.index(n)] for n in states],
            # per output: the state it is (its runtime input), or its dtype as the graph made it
            "outputs": [[runtime.index(state_of(o))] if state_of(o) in states else str(o.meta["val"].dtype).removeprefix("torch.")
                        for o in graph.outputs()]}


def _states(graph: CapturedGraph) -> list[str]:
    """The placeholders the graph writes, in the order of its placeholders: the order of the
    exported program's mutable buffers, which the converter names positionally."""
    written = set(written_states(graph))
    return [n.name for n in graph.placeholders() if n.name in written]


def _runtime_array(t: torch.Tensor) -> np.ndarray:
    a = t.detach().contiguous().numpy()
    return a.astype(np.int32) if a.dtype == np.int64 else a


delegate = CoreAI()

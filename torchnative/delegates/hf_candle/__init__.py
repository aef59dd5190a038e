"""HF candle on CPU through its Python bindings (`candle-nn` 0.4.2): a Core ATen subgraph becomes
a list of candle calls that a small interpreter runs. Params (and whatever is computed from them
alone) are converted to candle once, at compile. `candle-q8_0` and `candle-q4k` also store the
param weights that feed matmuls as GGUF blocks of that type, so they are inexact by design.

Here: the `Candle` delegate (available, supports, compile, load) and its instances. Beside it:
transfer.py (tensors in and out of candle), lowerings.py (the aten → candle table), fold.py (the
constant folder), gguf.py (the artifact's weights, k-quant blocks included) and interpreter.py
(running a lowered graph)."""
from __future__ import annotations

import importlib.metadata
import importlib.util
import os

import torch
import torch.fx as fx

from torchnative.delegates.base import tensors
from torchnative.delegates.hf_candle.fold import fold
from torchnative.delegates.hf_candle.gguf import GGUF_NAMES, pack, unpack, weight
from torchnative.delegates.hf_candle.interpreter import failure, interpreter
from torchnative.delegates.hf_candle.lowerings import CHECKS, CONSTANT, LOWER, MISSING
from torchnative.delegates.hf_candle.transfer import DTYPES
from torchnative.interface import FLOAT32, YES, Artifact, Availability, Runner, Support, Tolerance
from torchnative.ir import CapturedGraph

_VERSION = "0.4.2"
_HINT = f"pip install candle-nn=={_VERSION}"


class Candle:
    external_weights = False
    writes_in_place = False
    composites: frozenset[str] = frozenset()
    toolchain = ("candle-nn",)
    extension = "bin"
    calibrates = False
    dynamic = False  # static shapes: the partitioner leaves nodes whose sizes vary to eager

    def __init__(self, name: str, quant: str | None = None):
        self.name, self.quant = name, quant

    def available(self) -> Availability:
        if importlib.util.find_spec("candle") is None:
            return Availability("unavailable", "candle-nn is not installed", _HINT)
        version = importlib.metadata.version("candle-nn")
        if version != _VERSION:
            return Availability("unavailable", f"candle-nn {version} is installed; this delegate is verified on "
                                               f"{_VERSION}", _HINT)
        if not hasattr(os, "memfd_create"):
            return Availability("unavailable", "tensors move through os.memfd_create, which this OS lacks")
        return Availability("executes")

    def tolerance(self, graph: CapturedGraph) -> Tolerance:
        """Its GGUF k-quant kernels quantize the activations too: measured against float32
        (tests/test_candle.py: about half these), for its own quantization or the quantize pass's."""
        passed = {n.meta["kquant"].ggml_dtype for n in graph.placeholders() if "kquant" in n.meta}
        quant = self.quant or ("q4k" if any("Q4" in str(d).upper() for d in passed) else "q8_0" if passed else None)
        return {None: FLOAT32, "q8_0": Tolerance("l2", 0.03, "q8_0 weights, activations quantized by the kernel"),
                "q4k": Tolerance("l2", 0.15, "4-bit k-quant weights")}[quant]

    def supports(self, node: fx.Node) -> Support:
        if node.target not in LOWER and node.target not in CONSTANT:
            name = getattr(node.target, "_schema", None) and node.target._schema.name.split("::")[1]
            why = next((w for k, w in MISSING.items() if name and name.startswith(k)), None)
            return Support(False, why or f"no candle lowering for {node.target}")
        for v in tensors(node):
            if v.dtype not in DTYPES:
                held = v.dtype in (torch.float16, torch.bfloat16, torch.float64, torch.uint8)
                return Support(False, f"{v.dtype} tensors: " + (
                    "candle holds them, but only float32 (with int64 and bool) is verified here" if held
                    else "candle has no such dtype (u8 u32 i64 f16 bf16 f32 f64)"))
            if v.numel() == 0:
                return Support(False, "empty tensors")
            if any(isinstance(s, torch.SymInt) for s in v.shape):
                return Support(False, "symbolic shapes: candle programs are built for static shapes")
        if node.target in CONSTANT and node.all_input_nodes:
            return Support(False, f"{node.target} of runtime values")
        why = CHECKS[node.target](node) if node.target in CHECKS else None
        return Support(False, f"{why} ({node.target})") if why else YES

    def compile(self, graph: CapturedGraph) -> Artifact:
        try:
            return self._compile(graph)
        except (Exception, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:  # a candle panic, which callers catching Exception would miss
            raise failure(self.name, "compile", e) from e

    def load(self, artifact: Artifact) -> Runner:
        try:
            return self._load(artifact)
        except (Exception, KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            raise failure(self.name, "load", e) from e

    def _compile(self, graph: CapturedGraph) -> Artifact:
        values, origin = fold(graph)
        kept = [n for n in values if any(u not in values for u in n.users)]
        fp32, quantize = [], {}
        # the quantize pass's k-quants (passes.quantize): made already, of the values eager uses
        blocks = {n.name: n.meta["kquant"] for n in kept if "kquant" in n.meta}
        for n in (n for n in kept if n.name not in blocks):
            w = weight(n, values[n], self.quant if n in origin else None)
            if w is None:
                fp32.append((n.name, values[n].contiguous()))
            else:
                quantize[n.name] = w
        packed, gguf = pack(fp32, quantize, blocks, self.quant)
        meta = {"folded": sorted(n.name for n in values), "safetensors_bytes": len(packed),
                "quantized": {origin[n]: GGUF_NAMES.get(blocks[n.name].ggml_dtype, blocks[n.name].ggml_dtype)
                              for n in kept if n.name in blocks},
                "fp32_weights": sorted({origin[n] for n in kept if n in origin and n.name not in blocks})}
        return Artifact(self.name, packed + gguf, meta, live=graph)

    def _load(self, artifact: Artifact) -> Runner:
        meta = artifact.meta
        constants = unpack(memoryview(artifact.payload), meta["safetensors_bytes"])
        return interpreter(artifact.live, set(meta["folded"]), constants, self.name)


delegate = Candle("candle")
q8_0 = Candle("candle-q8_0", "q8_0")
q4k = Candle("candle-q4k", "q4k")

"""Qualcomm Hexagon NPU (HTP) through ONNX Runtime's QNN execution provider.

Subgraph → ONNX (the `ort` path) → QDQ quantization calibrated on the values the graph saw when
it was built (uint16 activations, int8 per-channel weights by default) → compiled for HTP by the
QNN libraries into a context binary, embedded in an EPContext model: that model is the artifact,
and loading it skips HTP graph preparation. CPU fallback is disabled, so a node HTP rejects fails
the compile (the partition then runs on eager, with the reason) instead of running silently on
CPU. Which nodes HTP takes is found by compiling each kind of node alone (delegates/probe.py). On x86_64 the QNN libraries run HTP in a simulator: results are
the NPU's, times are not.
"""
from __future__ import annotations

import functools
import importlib.util
import platform
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.fx as fx

from torchnative.interface import Artifact, Availability, Runner, Support, Tolerance
from torchnative.delegates import onnx_export
from torchnative.delegates.onnx_export import to_onnx
from torchnative.delegates.ort import delegate as ort_delegate
from torchnative.delegates.probe import Probe, random_inputs
from torchnative.ir import CapturedGraph, is_weight
from torchnative.quiet import quiet

_HINT = "pip install onnxruntime-qnn==2.7.0"
_TYPES = {"uint8": "QUInt8", "uint16": "QUInt16", "int8": "QInt8", "int16": "QInt16"}


@functools.cache
def _devices() -> tuple:
    import onnxruntime as ort
    import onnxruntime_qnn

    ort.register_execution_provider_library("QNNExecutionProvider", onnxruntime_qnn.get_library_path())
    return tuple(d for d in ort.get_ep_devices() if d.ep_name == "QNNExecutionProvider")


def _options(**config: str):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.log_severity_level = 4  # a node HTP rejects is an exception (and a reason), not a log line
    options.add_session_config_entry("session.disable_cpu_ep_fallback", "1")  # nothing runs on CPU unseen
    for k, v in config.items():
        options.add_session_config_entry(k, v)
    options.add_provider_for_devices(list(_devices()), {"backend_type": "htp"})
    return options


def _positive(t: torch.Tensor) -> torch.Tensor:
    return t.abs() + 0.1 if t.is_floating_point() else t


def _runtime_samples(graph: CapturedGraph) -> list[list[np.ndarray]]:
    """Calibration inputs: the sets of values the graph was built with and calibrated on, else
    (a probe's graph) positive noise: a NaN of rsqrt or log on normal noise leaves the quantizer
    no range ("scale issue")."""
    placeholders = graph.placeholders()
    sets = graph.samples or [[_positive(torch.randn(n.meta["val"].shape)) for n in placeholders]]
    return [[s.detach().contiguous().numpy() for s, r in zip(values, graph.input_roles) if not is_weight(r)]
            for values in sets]


# uint16 activations and int8 per-channel weights: a partition's relative L2 error (the op table's
# worst per op is ~0.005, a model's ~0.02; small Qwen3/Llama/GPT-2 logits 0.013-0.017; tests/test_qnn.py)
_HTP = Tolerance("l2", 0.05, "HTP computes with uint16 activations and int8 weights")


class Qnn:
    name = "qnn"
    external_weights = False
    writes_in_place = False
    composites: frozenset[str] = frozenset()
    calibrates = True  # wants graph.samples: activation ranges come from real values
    dynamic = False  # static shapes: the partitioner leaves nodes whose sizes vary to eager
    toolchain = ("onnxruntime", "onnxruntime-qnn", "onnx", "onnxscript")
    extension = "onnx"

    def __init__(self, activations: str = "uint16", weights: str = "int8"):
        self.activations, self.weights = activations, weights
        self._probe = Probe(self, "qnn-ops-2", "HTP", lambda alone: _try_on_htp(self, alone))

    def available(self) -> Availability:
        missing = [m for m in ("onnxruntime", "onnxruntime_qnn", "onnxscript", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return Availability("unavailable", f"missing {', '.join(missing)}", _HINT)
        try:
            devices = _devices()
        except Exception as e:  # an onnxruntime without plugin execution providers, a broken library
            return Availability("unavailable", f"the QNN execution provider did not register: {e}", _HINT)
        if not devices:
            return Availability("unavailable", "the QNN execution provider lists no device", _HINT)
        simulated = platform.machine() in ("x86_64", "AMD64")
        return Availability("executes", "HTP simulated on this CPU: results are the NPU's, times are the simulator's"
                            if simulated else "")

    def tolerance(self, graph: CapturedGraph) -> Tolerance:
        return _HTP

    def prepare(self) -> None:
        onnx_export.prepare()

    def supports(self, node: fx.Node) -> Support:
        verdict = ort_delegate.supports(node)
        if not verdict:
            return verdict
        for x in (node, *node.all_input_nodes):
            v = x.meta.get("val")
            v = v[0] if isinstance(v, (tuple, list)) and v else v
            if isinstance(v, torch.Tensor) and v.dtype != torch.float32:
                return Support(False, f"{v.dtype} tensors: this delegate quantizes float32 graphs for HTP")
        return self._probe(node)

    def compile(self, graph: CapturedGraph) -> Artifact:
        import onnx
        import onnxruntime as ort
        from onnxruntime.quantization import CalibrationDataReader, QuantType, quantize
        from onnxruntime.quantization.execution_providers.qnn import get_qnn_qdq_config
        from onnxruntime.quantization.shape_inference import quant_pre_process

        model = _finite_masks(_reciprocal_as_div(to_onnx(graph)))
        names = [i.name for i in model.graph.input]
        if not names:  # nodes claimed for their consumers (views of weights) left without them
            raise ValueError("the partition computes from weights alone: nothing to calibrate or run on HTP")
        feeds = [dict(zip(names, values)) for values in _runtime_samples(graph)]

        class _Sets(CalibrationDataReader):
            def __init__(self):
                self.left = feeds[::-1]

            def get_next(self):
                return self.left.pop() if self.left else None

        # onnxruntime.quantization advises on the root logger (pre-processing, opset upgrades)
        with tempfile.TemporaryDirectory() as tmp, quiet():
            fp32, qdq, context = (str(Path(tmp) / f) for f in ("fp32.onnx", "qdq.onnx", "context.onnx"))
            onnx.save(model, fp32 + ".raw")
            # folds the transposes of constant weights and the like: HTP rejects a Gemm whose
            # weight arrives through a Transpose
            quant_pre_process(fp32 + ".raw", fp32, skip_symbolic_shape=True)
            config = get_qnn_qdq_config(fp32, _Sets(), activation_type=getattr(QuantType, _TYPES[self.activations]),
                                        weight_type=getattr(QuantType, _TYPES[self.weights]), per_channel=True)
            quantize(fp32, qdq, config)
            # compiling for HTP writes the context binary, embedded in an EPContext model
            ort.InferenceSession(qdq, _options(**{"ep.context_enable": "1", "ep.context_embed_mode": "1",
                                                  "ep.context_file_path": context}))
            payload = Path(context).read_bytes()
        return Artifact(self.name, payload, {"n_outputs": len(graph.output_roles), "activations": self.activations,
                                             "weights": self.weights})

    def load(self, artifact: Artifact) -> Runner:
        import onnxruntime as ort

        session = ort.InferenceSession(artifact.payload, _options())
        names = [i.name for i in session.get_inputs()]
        run = session.run

        def runner(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            feed = {n: t.detach().contiguous().numpy() for n, t in zip(names, inputs)}
            return [torch.from_numpy(v) for v in run(None, feed)]

        return runner


def _reciprocal_as_div(model):
    """Every Reciprocal(x) as Div(1, x). HTP's quantized Reciprocal (QNN 2.51, uint16) returns
    values ~95 % off (relative L2) where Div(1, x) on the same quantized input is exact: rsqrt
    (Sqrt then Reciprocal in ONNX) in every RMSNorm sent a causal LM's logits 39 % off eager's."""
    from onnx import numpy_helper

    nodes = [n for n in model.graph.node if n.op_type == "Reciprocal"]
    if not nodes:
        return model
    one = "torchnative_qnn_one"
    model.graph.initializer.append(numpy_helper.from_array(np.array(1.0, np.float32), one))
    for n in nodes:
        n.op_type = "Div"
        n.input.insert(0, one)
    return model


# a score this far below its row's others weighs exp(-1000) = 0 in float32 (underflow at -104),
# unless a masked key scored ~900 above every visible one; uint16 spans it in steps of ~0.015
MASKED = -1e3
_SENTINEL = -1e30  # a constant this low is a mask's "never", not a value


def _finite_masks(model):
    """-inf and float32's lowest in constants (the causal masks added to attention scores) as
    MASKED: HTP refuses to compose an Add of a quantized -inf (QNN error 6007: causal attention
    ran on eager), and a uint16 range down to -3.4e38 has steps of 5e33: softmax's input all one
    value (a causal attention 21 % off eager)."""
    from onnx import numpy_helper

    def finite(t):
        a = numpy_helper.to_array(t)
        if a.dtype.kind != "f" or not (a <= _SENTINEL).any():
            return None
        return numpy_helper.from_array(np.where(a <= _SENTINEL, np.asarray(MASKED, a.dtype), a), t.name)

    for i, t in enumerate(model.graph.initializer):
        if (new := finite(t)) is not None:
            model.graph.initializer[i].CopyFrom(new)
    for n in model.graph.node:
        for a in n.attribute if n.op_type in ("Constant", "ConstantOfShape") else ():
            if a.name == "value" and (new := finite(a.t)) is not None:
                a.t.CopyFrom(new)
            elif a.name == "value_float" and a.f <= _SENTINEL:
                a.f = MASKED
            elif a.name == "value_floats":
                a.floats[:] = [MASKED if f <= _SENTINEL else f for f in a.floats]
    return model


def _try_on_htp(qnn: Qnn, alone: CapturedGraph) -> None:
    inputs = [_positive(t) for t in random_inputs(alone)]  # as calibrated
    if inputs:  # else computed from weights alone: folded before HTP sees it
        qnn.load(qnn.compile(alone))(inputs)


delegate = Qnn()

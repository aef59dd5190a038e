"""ONNX Runtime on CPU: the delegate. A Core ATen subgraph → ONNX (onnx_export) → an
InferenceSession on the CPU execution provider, its baked weights handed over as external
initializers; the runners, which bind a state update's output to the caller's own tensor (IO
binding) so that it is written in place."""
from __future__ import annotations

import functools
import importlib.util
import operator
import threading

import torch
import torch.fx as fx

from torchnative import threads
from torchnative.delegates.base import tensors
from torchnative.delegates.onnx_export import (BATCH_NORM_TRAINING, SDPA, laid_out, low_bit_layouts, saved_read,
                                                slice_write, to_onnx, translated)
from torchnative.delegates import onnx_export
from torchnative.interface import FLOAT32, YES, Artifact, Availability, Runner, Support, Tolerance
from torchnative.ir import CapturedGraph, is_weight
from torchnative.passes.fuse import COMPOSITES
from torchnative.passes.scalars import as_tensors, is_scalar, placed
from torchnative.passes.state import SLICE_UPDATE

_HINT = "pip install onnxruntime onnxscript onnx"
_INDEX_PUT = torch.ops.aten.index_put.default

# found wrong by the OpInfo sweep (tests/opinfo_sweep.py --delegates ort)
_WRONG = frozenset({"_native_batch_norm_legit_functional", "_native_batch_norm_legit", "native_batch_norm",
                    "aminmax", "view_as_complex", "view_as_real", "complex", "polar"})
# measured slower on ONNX Runtime than eager's kernel, by far
_SLOWER = {torch.ops.aten.native_batch_norm_backward.default:
           "slower in ONNX Runtime than eager's fused kernel (its reductions over N, H, W of an NCHW tensor: a "
           "ResNet-50 TENT step's BN backward partitions took 100-300 ms each)"}
_REDUCTIONS = frozenset({"amax", "amin", "logsumexp", "max", "min", "argmax", "argmin"})
# Equal values come out of torch's CPU topk and unstable sort in the order its selection
# (std::nth_element, partial_sort, an unstable sort) leaves them, out of ONNX's TopK lower index
# first: with ties the indices differ (RT-DETR's query selection over equal scores gathered other
# queries). The values alone are the same in any order.
_TIE_ORDER = frozenset({torch.ops.aten.topk.default, torch.ops.aten.sort.default})


def _externalize(model, constants: dict[str, torch.Tensor]) -> list[str]:
    """Initializers that are our baked weights become external references by name (their data is
    handed to ONNX Runtime at load); the payload then holds the graph alone."""
    import onnx
    from onnx import external_data_helper

    moved = []
    for init in model.graph.initializer:
        t = constants.get(init.name)
        if t is not None and t.numel() > 1 and list(init.dims) == list(t.shape):
            moved.append(init.name)
            if init.data_location == onnx.TensorProto.EXTERNAL:  # to_onnx(weights_apart=True) wrote it so
                continue
            external_data_helper.set_external_data(init, location=f"{init.name}.weight")
            for data in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                init.ClearField(data)
            init.data_location = onnx.TensorProto.EXTERNAL
    return moved


def _add_initializers(model, tensors: dict[str, torch.Tensor]) -> None:
    """The tensors as initializers; those no node reads any more (a low-bit kernel's weight's
    source) removed."""
    from onnx import numpy_helper

    for name, t in tensors.items():
        model.graph.initializer.append(numpy_helper.from_array(t.numpy(), name))
    read = {i for n in model.graph.node for i in n.input} | {o.name for o in model.graph.output}
    for init in [init for init in model.graph.initializer if init.name not in read]:
        model.graph.initializer.remove(init)


# quantize="int8" and "int4" (int8 values in the graph): their kernels quantize the activations too
# (MatMulInteger per tensor, MatMulNBits in blocks of 32: passes.quantize.low_bit_activations), ~1 %
# of an output's largest value on GPT-2 small's logits (benchmarks/quantized_decode.py)
_INT8 = Tolerance("scale", 0.05, "int8/int4 matmuls quantize their activations: ~1 % of an output's scale")


class OnnxRuntime:
    name = "ort"
    external_weights = True  # weights go to ONNX Runtime as external initializers: not copied, not stored twice
    writes_in_place = True  # a state update's output is bound to the state's buffer (_writing_runner)
    composites = frozenset(COMPOSITES) - {"gelu_tanh"}  # its optimizer fuses GELU's tanh pattern itself
    toolchain = ("onnxruntime", "onnx", "onnxscript")
    extension = "onnx"
    calibrates = False
    dynamic = True  # the export's dynamic_shapes become the ONNX model's symbolic dims
    scalar_inputs = True  # as 0-d tensor inputs (passes.scalars)

    def available(self) -> Availability:
        missing = [m for m in ("onnxruntime", "onnxscript", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return Availability("unavailable", f"missing {', '.join(missing)}", _HINT)
        return Availability("executes")

    def prepare(self) -> None:
        onnx_export.prepare()

    def tolerance(self, graph: CapturedGraph) -> Tolerance:
        if any(p.meta["val"].dtype == torch.int8 for p in graph.placeholders() if isinstance(p.meta.get("val"), torch.Tensor)):
            return _INT8
        return FLOAT32

    def supports(self, node: fx.Node) -> Support:
        if node.target is SLICE_UPDATE:
            if node.args[0].op != "placeholder" or not slice_write(node):
                return Support(False, "a state update is written in place only into a graph input, along one dim "
                                      "by a 1-D integer index (one ScatterND)")
            return YES
        if not isinstance(node.target, torch._ops.OpOverload):
            return Support(False, f"{node.target} is not an aten op")
        if not translated(node.target):
            return Support(False, f"no ONNX translation of {node.target}: torchlib has none, nor onnx_export")
        name = node.target._schema.name.split("::")[1]
        if (name in _WRONG and node.target not in BATCH_NORM_TRAINING) or name.startswith(("special_", "linalg_", "_linalg_", "_fft_")):
            return Support(False, f"torchlib's translation of {node.target} disagrees with eager (OpInfo sweep)")
        for v in tensors(node):
            if v.dtype.is_complex or v.dtype == torch.bfloat16:
                return Support(False, f"{v.dtype} tensors: ONNX Runtime's CPU kernels or numpy cannot hold them")
        if name in ("gelu", "erf") and any(v.dtype == torch.float64 for v in tensors(node)):
            return Support(False, "float64 GELU and erf: ONNX Runtime has no float64 Erf kernel, and torchlib's tanh "
                                  "GELU rounds its constants to float32 (1e-9 off eager)")
        if name in _REDUCTIONS and any(v.dim() == 0 for v in tensors(node)):
            return Support(False, f"{node.target} of a 0-d tensor does not convert")
        if name.startswith("avg_pool") and len(node.args) > 4 and node.args[4]:
            return Support(False, "avg_pool with ceil_mode=True differs from eager at the edges")
        if any(is_scalar(u) for u in node.all_input_nodes) and not placed(node):
            return Support(False, "reads a Python float that changes between calls where ONNX takes a constant "
                                  "(not a tensor argument): eager runs it")
        if node.target in _SLOWER:
            return Support(False, _SLOWER[node.target])
        if node.target in _TIE_ORDER and any(u.target is operator.getitem and u.args[1] == 1 and u.users
                                             for u in node.users):
            return Support(False, f"{node.target}'s indices: torch orders equal values as its CPU kernel's selection "
                                  "leaves them, ONNX TopK by lower index first; with ties the indices differ")
        dropout = node.args[3] if len(node.args) > 3 else node.kwargs.get("dropout_p", 0.0)
        if node.target in SDPA and saved_read(node) and dropout:
            return Support(False, "torchlib's translation of attention with dropout computes the output only, not "
                                  "the logsumexp that autograd saves (the call runs with grad enabled)")
        return YES

    def compile(self, graph: CapturedGraph) -> Artifact:
        outputs = [(list(n.meta["val"].shape), str(n.meta["val"].dtype).removeprefix("torch."))
                   for n in graph.outputs()]
        graph, written = _functional_writes(graph)
        graph, scalars = as_tensors(graph)
        ranges: dict = {}
        model = to_onnx(graph, ranges, weights_apart=True)
        recipe = low_bit_layouts(model)
        made = laid_out(recipe, graph.constants)
        if made:
            _add_initializers(model, made)
        external = _externalize(model, {**graph.constants, **made})
        meta = {"n_outputs": len(outputs), "external": sorted(external)}
        if scalars:  # their positions among the runtime inputs, which the runner makes tensors
            runtime = [k for k, role in enumerate(graph.input_roles) if not is_weight(role)]
            meta["scalars"] = [runtime.index(k) for k in scalars]
        if recipe:
            meta["low_bit"] = recipe
        if written:
            reused = [k for k, role in enumerate(graph.output_roles[:len(outputs)]) if role == "written_back"]
            meta.update(written=written, outputs=outputs, reused=reused)
        kept = [n for n in external if n in graph.constants] + [source for _, source in recipe.values()]
        return Artifact(self.name, model.SerializeToString(), meta, {n: graph.constants[n] for n in kept}, ranges=ranges)

    def load(self, artifact: Artifact) -> Runner:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = threads.for_programs()
        # fatal only: its optimizer's notes are not the user's business, and a run's error is raised
        # (a token id past the vocabulary: eager's error is the user's, not ONNX Runtime's log line)
        options.log_severity_level = 4
        # Each session has its own pool, whose threads by default keep spinning after a run; the
        # next partition's session (or torch) then shares 2 cores with them: BERT-base's 472-op
        # graph ran 187 ms after the 14-op mask graph with spinning, 151 ms without (148 ms
        # alone). Spinning within a run and stopping at its end beat no spinning at all, in one
        # process, each session followed by torch work: GPT-2 decode 34.6-45.1 vs 36.2-49.1 ms,
        # BERT 206-226 vs 216-243 ms (always spinning: 42.8-51.9 and 261-272 ms).
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        recipe = artifact.meta.get("low_bit", {})
        if any(source not in artifact.constants for _, source in recipe.values()):
            raise ValueError(f"the ONNX model's low-bit weights are made from weights {sorted(s for _, s in recipe.values())[:3]} "
                             "that were not given to load")
        constants = {**artifact.constants, **laid_out(recipe, artifact.constants)}
        missing = [n for n in artifact.meta.get("external", ()) if n not in constants]
        if missing:
            raise ValueError(f"the ONNX model names weights {missing[:3]} that were not given to load")
        weights = {n: constants[n].detach().contiguous().numpy() for n in artifact.meta.get("external", ())}
        # views of the tensors, which the session copies as it is made (GPT-2 small's 474 MB of
        # weights: +645-665 MB resident per program; prepacking off +638, every graph
        # optimization off +518): every ONNX Runtime program of a model holds its own copy of the
        # weights. Shared initializers (add_initializer) are read in place only with prepacking
        # off, and the optimizer's constant folding then reads the model's placeholder data
        # instead (GPT-2's program failed verification)
        values = [ort.OrtValue.ortvalue_from_numpy(w) for w in weights.values()]
        if weights:
            options.add_external_initializers(list(weights), values)
        session = ort.InferenceSession(artifact.payload, options, providers=["CPUExecutionProvider"])
        if artifact.meta.get("written"):
            runner = _writing_runner(session, artifact.meta["written"], artifact.meta["outputs"],
                                     artifact.meta.get("reused", []), (weights, values))
            return _scalars_as_tensors(runner, artifact.meta.get("scalars", ()))
        names = [i.name for i in session.get_inputs()]
        run = session.run

        def runner(inputs: list[torch.Tensor], _keep=(weights, values)) -> list[torch.Tensor]:
            # _keep: the arrays the session was made from, alive as long as it is (it copied them)
            feed = {n: t.detach().contiguous().numpy() for n, t in zip(names, inputs)}
            return [torch.from_numpy(v) for v in run(None, feed)]

        return _scalars_as_tensors(runner, artifact.meta.get("scalars", ()))


def _scalars_as_tensors(runner: Runner, positions) -> Runner:
    """The runner given each call's Python floats at `positions` as the float64 0-d tensors its
    model takes (passes.scalars)."""
    if not positions:
        return runner

    def scalar_runner(inputs: list) -> list[torch.Tensor]:
        inputs = list(inputs)
        for k in positions:
            inputs[k] = torch.tensor(inputs[k], dtype=torch.float64)
        return runner(inputs)

    return scalar_runner


def _functional_writes(graph: CapturedGraph) -> tuple[CapturedGraph, list[int]]:
    """The graph with each state update `index_put_(s, i, v)` made functional and appended to
    its outputs, and for each appended output the runtime input `s` it is to be written into.
    The index_put(s, i, v) the graph computes beside it for its readers (passes.state) is the
    same value: it becomes that output, so one ScatterND reads s and writes it."""
    if not any(n.target is SLICE_UPDATE for n in graph.gm.graph.nodes):
        return graph, []
    graph = graph.copy()
    g = graph.gm.graph
    out = graph.output_node()
    runtime = [n for n, role in zip(graph.placeholders(), graph.input_roles) if not is_weight(role)]
    written, values = [], []
    for w in [n for n in g.nodes if n.target is SLICE_UPDATE]:
        state = w.args[0]
        twin = next((u for u in state.users if u.target is _INDEX_PUT and u.args[1:3] == w.args[1:3]
                     and not (len(u.args) > 3 and u.args[3]) and u not in out.args[0]), None)
        if twin is None:
            w.target, twin = _INDEX_PUT, w
        else:
            g.erase_node(w)
        values.append(twin)
        written.append(runtime.index(state))
    out.args = ([*out.args[0], *values],)
    graph.output_roles = [*graph.output_roles, *["output"] * len(values)]
    graph.gm.recompile()
    return graph, written


@functools.cache
def _numpy_dtype(dtype: torch.dtype):
    return torch.empty(0, dtype=dtype).numpy().dtype


def _writing_runner(session, written: list[int], outputs: list, reused: list[int], keep) -> Runner:
    """A runner that binds each written state input's own buffer as the output of its update:
    ONNX Runtime's ScatterND, whose output is then its input, writes the indexed rows and copies
    nothing (a GPT-2 decode step's 24 caches are 9.5 MB, which a plain run copies whole).
    Outputs are written into tensors allocated here; the `reused` ones ("written_back": a
    counter's new value, copied into the counter after the run) into the same tensors every
    call. A binding (one per thread) keeps what it was given (it holds the input arrays alive
    until they are replaced): a buffer at the same address as on the previous call is not bound
    again (binding a decode step's 37 inputs and 24 caches took 0.7-1.1 ms a call, 4 % of the step)."""
    import onnxruntime as ort

    names = [i.name for i in session.get_inputs()]
    out_names = [o.name for o in session.get_outputs()]
    kinds = [(shape, getattr(torch, dtype)) for shape, dtype in outputs]
    fresh = [(k, shape, dtype) for k, (shape, dtype) in enumerate(kinds) if k not in reused]
    cpu = ort.OrtDevice.make("cpu", 0)._get_c_device()
    local = threading.local()

    def runner(inputs: list[torch.Tensor], _keep=keep) -> list[torch.Tensor]:
        if not hasattr(local, "binding"):
            local.binding, local.bound, local.pointers = session.io_binding(), {}, None
            local.kept = [torch.empty(shape, dtype=dtype) if k in reused else None for k, (shape, dtype) in enumerate(kinds)]
        binding, bound = local.binding, local.bound
        pointers = [t.data_ptr() for t in inputs]
        dense = all([t.is_contiguous() for t in inputs])
        # the same buffers as on the last call (a decode step's): every input and written state
        # is bound already, only the new output tensors are not
        bound_before = dense and pointers == local.pointers
        if not bound_before:
            local.pointers = None
            for name, t in zip(names, inputs):
                if bound.get(name) != t.data_ptr() or not t.is_contiguous():
                    t = t.detach().contiguous()  # a strided input is bound as a copy, on every call
                    binding.bind_cpu_input(name, t.numpy())
                    bound[name] = t.data_ptr()
        results = local.kept.copy()
        for k, shape, dtype in fresh:
            results[k] = torch.empty(shape, dtype=dtype)
        to_bind = [(out_names[k], results[k]) for k, _, _ in fresh] if bound_before else \
            zip(out_names, results + [inputs[i] for i in written])
        for name, t in to_bind:
            if not t.is_contiguous():  # ONNX Runtime would write it as if it were
                raise RuntimeError(f"ort: the state tensor written in place as {name!r} is not contiguous "
                                   f"(strides {t.stride()}); eager writes it")
            if bound.get(name) != t.data_ptr():  # results are new tensors, mostly at new addresses
                # the binding's own object: its Python wrapper makes a device object on every
                # call, a third of this runner's time
                binding._iobinding.bind_output(name, cpu, _numpy_dtype(t.dtype), list(t.shape), t.data_ptr())
                bound[name] = t.data_ptr()
        if dense:
            local.pointers = pointers
        session.run_with_iobinding(binding)
        return results

    return runner


delegate = OnnxRuntime()

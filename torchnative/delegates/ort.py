"""ONNX Runtime on CPU: a Core ATen subgraph → ExportedProgram → ONNX (torch.onnx's torchlib
translation) → an InferenceSession on the CPU execution provider."""
from __future__ import annotations

import functools
import importlib.util
import logging
import math
import operator
import threading
import warnings

import torch
import torch.fx as fx

from torchnative.delegates.base import tensors
from torchnative.interface import YES, Artifact, Availability, Runner, Support
from torchnative.ir import CapturedGraph
from torchnative.passes.fuse import COMPOSITES, gelu_tanh_op, rms_norm_op, rope_op
from torchnative.passes.state import SLICE_UPDATE

_HINT = "pip install onnxruntime onnxscript onnx"
_SDPA = {torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default}
_INDEX_PUT = torch.ops.aten.index_put.default
_COMPOSITE_OPS = {rms_norm_op, rope_op, gelu_tanh_op}


def _cache_or_grouped_attention(node: fx.Node) -> bool:
    """Attention of fewer queries than keys (a step over a KV cache: torchlib's translation
    passes over the whole cache three times; ours ran a GPT-2 decode step 7.8 % faster, but BERT
    4.6 % and GPT-2 prefill 2.6 % slower), or with grouped KV heads (torchlib's takes none)."""
    q, k = (a.meta.get("val") for a in node.args[:2])
    return q is not None and k is not None and q.dim() == 4 and (q.shape[1] != k.shape[1] or q.shape[2] < k.shape[2])


def _slice_write(node: fx.Node) -> bool:
    """index_put along one dim by a 1-D index (a KV cache written at its positions)."""
    given = [i for i in node.args[1] if i is not None]
    return len(given) == 1 and given[0].meta.get("val") is not None and given[0].meta["val"].dim() == 1 \
        and not given[0].meta["val"].dtype.is_floating_point and given[0].meta["val"].dtype != torch.bool


# torchlib's translation is replaced only in graphs that have a node it handles badly
_OURS = {torch.ops.aten.index_put.default: _slice_write, **{sdpa: _cache_or_grouped_attention for sdpa in _SDPA}}


# found wrong by the OpInfo sweep (tests/opinfo_sweep.py --delegates ort)
_WRONG = frozenset({"_native_batch_norm_legit_functional", "_native_batch_norm_legit", "native_batch_norm",
                    "aminmax", "view_as_complex", "view_as_real", "complex", "polar"})
_REDUCTIONS = frozenset({"amax", "amin", "logsumexp", "max", "min", "argmax", "argmin"})


@functools.cache
def _registry():
    from torch.onnx._internal.exporter import _registration

    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    return _registration.ONNXRegistry.from_torchlib()


def _externalize(model, constants: dict[str, torch.Tensor]) -> list[str]:
    """Initializers that are our baked weights become external references by name (their data is
    handed to ONNX Runtime at load); the payload then holds the graph alone."""
    import onnx
    from onnx import external_data_helper

    moved = []
    for init in model.graph.initializer:
        t = constants.get(init.name)
        if t is not None and t.numel() > 1 and list(init.dims) == list(t.shape):
            external_data_helper.set_external_data(init, location=f"{init.name}.weight")
            for data in ("raw_data", "float_data", "int32_data", "int64_data", "double_data", "uint64_data"):
                init.ClearField(data)
            init.data_location = onnx.TensorProto.EXTERNAL
            moved.append(init.name)
    return moved


@functools.cache
def _translations() -> dict:
    """Our ONNX translations: the composites (passes.fuse) ONNX Runtime runs as one kernel
    (opset 23); attention and index_put where torchlib's are slow or missing (see _OURS)."""
    import numpy
    import onnx
    from onnxscript import opset23 as op

    def rms_norm(x, weight, eps: float):
        return op.RMSNormalization(x, weight, axis=-1, epsilon=eps, stash_type=1)

    def gelu_tanh(x):
        return op.Gelu(x, approximate="tanh")

    def rope(x, cos, sin):
        # the fusion proved cos and sin repeat their first half; ONNX's kernel reads that half,
        # [batch, positions, half] (cos is [batch or 1, 1, positions, head_size])
        batch, _, positions, size = x.shape
        ints = lambda *v: op.Constant(value_ints=list(v))  # noqa: E731

        def half(t):
            t = op.Squeeze(op.Slice(t, ints(0), ints(size // 2), ints(3)), ints(1))
            return op.Expand(t, ints(batch, positions, size // 2))
        return op.RotaryEmbedding(x, half(cos), half(sin))

    def attention(query, key, value, dropout_p: float = 0.0, is_causal: bool = False, attn_mask=None, scale=None):
        # softmax(q @ kᵀ · scale + mask) @ v in the form ONNX Runtime's optimizer fuses into one
        # FusedMatMul (transposed k, the scale as its alpha): torchlib's scales q and k by √scale
        # and transposes k itself, three passes over a KV cache per layer
        if dropout_p != 0.0:
            return torchlib_nn.aten__scaled_dot_product_flash_attention_for_cpu(
                query, key, value, dropout_p, is_causal, attn_mask, scale)
        batch, heads, length, size = query.shape
        kv_heads, positions = key.shape[1], key.shape[2]
        if kv_heads != heads:  # grouped-query: query head h reads KV head h // (heads / kv_heads)
            def repeat(t):
                t = op18.Expand(op18.Unsqueeze(t, ints([2])), ints([batch, kv_heads, heads // kv_heads, positions, size]))
                return op18.Reshape(t, ints([batch, heads, positions, -1]))
            key, value = repeat(key), repeat(value)
        scale = 1.0 / math.sqrt(size) if scale is None else scale
        # scaled after the product, as torch's CPU kernel does (before it, OpInfo's large samples differ by 1e-5)
        scores = op18.Mul(op18.MatMul(query, op18.Transpose(key, perm=[0, 1, 3, 2])), op18.Constant(value_float=scale))
        if is_causal:
            above = numpy.triu(numpy.full((length, positions), -numpy.inf, numpy.float32), 1)
            scores = op18.Add(scores, op18.Constant(value=onnx.numpy_helper.from_array(above)))
        if attn_mask is not None:
            scores = op18.Where(attn_mask, scores, op18.Constant(value_float=-math.inf)) \
                if attn_mask.dtype == onnx.TensorProto.BOOL else op18.Add(scores, attn_mask)
        out = op18.MatMul(op18.Softmax(scores, axis=-1), value)
        # the logsumexp autograd would save is never read (supports() declines the node when it
        # is): a placeholder of its shape
        return out, op18.Expand(op18.Constant(value_float=0.0), ints([batch, heads, length]))

    def index_put(data, indices, values, accumulate: bool = False):
        # torchlib's moves the indexed dim first and back: two transposes of the whole cache per
        # write, 15 % of a GPT-2 decode step. ScatterND with an index tuple per leading position
        # writes whole trailing slices where they are
        dim = next((d for d, i in enumerate(indices) if i is not None), None)
        if dim is None or sum(i is not None for i in indices) != 1 or len(indices[dim].shape) != 1:
            return torchlib_core.aten_index_put(data, indices, values, accumulate)
        lead = [*data.shape[:dim], indices[dim].shape[0]]
        grid = numpy.stack(numpy.meshgrid(*(numpy.arange(n) for n in lead), indexing="ij"), -1)[..., :-1]
        where = op18.Concat(op18.Constant(value=onnx.numpy_helper.from_array(grid.astype(numpy.int64))),
                            op18.Expand(op18.Reshape(indices[dim], ints([1] * dim + [-1, 1])), ints([*lead, 1])), axis=-1)
        return op18.ScatterND(data, where, op18.Expand(values, ints([*lead, *data.shape[dim + 1:]])),
                              reduction="add" if accumulate else "none")

    ints = lambda v: op18.Constant(value_ints=v)  # noqa: E731
    from onnxscript import opset18 as op18  # torchlib's opset: up-converts to the graph's
    from onnxscript.function_libs.torch_lib.ops import core as torchlib_core
    from onnxscript.function_libs.torch_lib.ops import nn as torchlib_nn

    return {rms_norm_op: rms_norm, gelu_tanh_op: gelu_tanh, rope_op: rope, torch.ops.aten.index_put.default: index_put,
            **{sdpa: attention for sdpa in _SDPA}}


def to_onnx(graph: CapturedGraph):
    """The graph as an ONNX ModelProto (torchlib's translation of its ExportedProgram); its
    constants are initializers named like their placeholders. Opset 23 where a composite needs
    its kernels, else the exporter's default (20): plain graphs ran 1-2 % slower at 23."""
    nodes = graph.gm.graph.nodes
    composite = any(n.target in _COMPOSITE_OPS for n in nodes)
    needed = {n.target for n in nodes if n.target in _OURS and _OURS[n.target](n)}
    table = {op: fn for op, fn in _translations().items() if op in needed or op not in _OURS}
    exported = graph.to_exported_program()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(exported, dynamo=True, optimize=False, verbose=False, opset_version=23 if composite else None,
                                 custom_translation_table=table).model_proto


class OnnxRuntime:
    name = "ort"
    external_weights = True  # weights go to ONNX Runtime as external initializers: not copied, not stored twice
    writes_in_place = True  # a state update's output is bound to the state's buffer (_writing_runner)
    composites = frozenset(COMPOSITES) - {"gelu_tanh"}  # its optimizer fuses GELU's tanh pattern itself
    toolchain = ("onnxruntime", "onnx", "onnxscript")
    extension = "onnx"
    calibrates = False

    def available(self) -> Availability:
        missing = [m for m in ("onnxruntime", "onnxscript", "onnx") if importlib.util.find_spec(m) is None]
        if missing:
            return Availability("unavailable", f"missing {', '.join(missing)}", _HINT)
        return Availability("executes")

    def supports(self, node: fx.Node) -> Support:
        if node.target is SLICE_UPDATE:
            if node.args[0].op != "placeholder" or not _slice_write(node):
                return Support(False, "a state update is written in place only into a graph input, along one dim "
                                      "by a 1-D integer index (one ScatterND)")
            return YES
        if not isinstance(node.target, torch._ops.OpOverload):
            return Support(False, f"{node.target} is not an aten op")
        if not _registry().is_registered(node.target):
            return Support(False, f"no ONNX translation of {node.target} in torchlib")
        name = node.target._schema.name.split("::")[1]
        if name in _WRONG or name.startswith(("special_", "linalg_", "_linalg_", "_fft_")):
            return Support(False, f"torchlib's translation of {node.target} disagrees with eager (OpInfo sweep)")
        for v in tensors(node):
            if v.dtype.is_complex or v.dtype == torch.bfloat16:
                return Support(False, f"{v.dtype} tensors: ONNX Runtime's CPU kernels or numpy cannot hold them")
        if name in _REDUCTIONS and any(v.dim() == 0 for v in tensors(node)):
            return Support(False, f"{node.target} of a 0-d tensor does not convert")
        if name.startswith("avg_pool") and len(node.args) > 4 and node.args[4]:
            return Support(False, "avg_pool with ceil_mode=True differs from eager at the edges")
        if node.target in _SDPA and any(u.target is operator.getitem and u.args[1] != 0 and u.users for u in node.users):
            return Support(False, "torchlib's SDPA translation computes the attention output only, not the "
                                  "logsumexp that autograd saves (the call runs with grad enabled)")
        return YES

    def compile(self, graph: CapturedGraph) -> Artifact:
        outputs = [(list(n.meta["val"].shape), str(n.meta["val"].dtype).removeprefix("torch."))
                   for n in next(n for n in graph.gm.graph.nodes if n.op == "output").args[0]]
        graph, written = _functional_writes(graph)
        model = to_onnx(graph)
        external = _externalize(model, graph.constants)
        meta = {"n_outputs": len(outputs), "external": sorted(external)}
        if written:
            reused = [k for k, role in enumerate(graph.output_roles[:len(outputs)]) if role == "written_back"]
            meta.update(written=written, outputs=outputs, reused=reused)
        return Artifact(self.name, model.SerializeToString(), meta, {n: graph.constants[n] for n in external})

    def load(self, artifact: Artifact) -> Runner:
        import onnxruntime as ort

        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()
        options.log_severity_level = 3  # errors only: its optimizer's notes are not the user's business
        # Each session has its own pool, whose threads by default keep spinning after a run; the
        # next partition's session (or torch) then shares 2 cores with them: BERT-base's 472-op
        # graph ran 187 ms after the 14-op mask graph with spinning, 151 ms without (148 ms
        # alone). Spinning within a run and stopping at its end beat no spinning at all, in one
        # process, each session followed by torch work: GPT-2 decode 34.6-45.1 vs 36.2-49.1 ms,
        # BERT 206-226 vs 216-243 ms (always spinning: 42.8-51.9 and 261-272 ms).
        options.add_session_config_entry("session.intra_op.allow_spinning", "1")
        options.add_session_config_entry("session.force_spinning_stop", "1")
        missing = [n for n in artifact.meta.get("external", ()) if n not in artifact.constants]
        if missing:
            raise ValueError(f"the ONNX model names weights {missing[:3]} that were not given to load")
        weights = {n: artifact.constants[n].detach().contiguous().numpy() for n in artifact.meta.get("external", ())}
        values = [ort.OrtValue.ortvalue_from_numpy(w) for w in weights.values()]  # views of the tensors: no copy
        if weights:
            options.add_external_initializers(list(weights), values)
        session = ort.InferenceSession(artifact.payload, options, providers=["CPUExecutionProvider"])
        if artifact.meta.get("written"):
            return _writing_runner(session, artifact.meta["written"], artifact.meta["outputs"], artifact.meta.get("reused", []),
                                   (weights, values))
        names = [i.name for i in session.get_inputs()]
        run = session.run

        def runner(inputs: list[torch.Tensor], _keep=(weights, values)) -> list[torch.Tensor]:
            # _keep: ONNX Runtime reads the weights in place; they must outlive the session
            feed = {n: t.detach().contiguous().numpy() for n, t in zip(names, inputs)}
            return [torch.from_numpy(v) for v in run(None, feed)]

        return runner


def _functional_writes(graph: CapturedGraph) -> tuple[CapturedGraph, list[int]]:
    """The graph with each state update `index_put_(s, i, v)` made functional and appended to
    its outputs, and for each appended output the runtime input `s` it is to be written into.
    The index_put(s, i, v) the graph computes beside it for its readers (passes.state) is the
    same value: it becomes that output, so one ScatterND reads s and writes it."""
    if not any(n.target is SLICE_UPDATE for n in graph.gm.graph.nodes):
        return graph, []
    graph = graph.copy()
    g = graph.gm.graph
    out = next(n for n in g.nodes if n.op == "output")
    runtime = [n for n, role in zip((n for n in g.nodes if n.op == "placeholder"), graph.input_roles)
               if role not in ("param", "constant")]
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

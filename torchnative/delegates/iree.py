"""GPUs through IREE: a Core ATen subgraph → ExportedProgram → MLIR torch dialect (IREE's
FxImporter) → `iree-compile` for Vulkan SPIR-V (`vulkan`) or host LLVM CPU code (`iree-cpu`) →
a .vmfb run by IREE's runtime.

Weights are function arguments, not constants in the module: the artifact holds code alone (small,
reusable across weights, like the `ort` delegate's), and the weights are uploaded to the device
once, at load. `iree-compile` runs as a subprocess, so a compiler crash is an exception here.
Which nodes a target takes is found by compiling each kind of node alone (delegates/probe.py): the
Vulkan baseline target has no 64-bit integer arithmetic, for one.

On this machine Vulkan is Mesa's lavapipe, a software rasterizer on the CPU: results are the GPU
path's, times are not a GPU's.
"""
from __future__ import annotations

import importlib.util
import io
import os
import re
import threading
import weakref

import numpy as np
import torch
import torch.fx as fx

from torchnative.delegates.base import tensors
from torchnative.interface import Artifact, Availability, Runner, Support
from torchnative.delegates.probe import Probe
from torchnative.ir import CapturedGraph
from torchnative.passes.attention import as_sdpa, zero_masked_rows

_HINT = "pip install iree-base-compiler==3.13.* iree-base-runtime==3.13.*"
_VULKAN_HINT = "apt-get install mesa-vulkan-drivers libvulkan1 (software Vulkan), or a GPU's Vulkan driver"
# BatchNorm reaches the importer as one op that torch-mlir does not lower; the whole family must
# decompose together (the no_training decomposition produces the others)
_BATCH_NORM = ("_native_batch_norm_legit_no_training.default", "_native_batch_norm_legit_functional.default",
               "_native_batch_norm_legit.default", "_native_batch_norm_legit.no_stats")
_DTYPES = {torch.float32, torch.float16, torch.int64, torch.int32, torch.bool, torch.int8, torch.uint8}


def _ops(names: tuple[str, ...]) -> list:
    return [getattr(getattr(torch.ops.aten, n.split(".")[0]), n.split(".")[1]) for n in names]


def _decompose(exported: torch.export.ExportedProgram, names: tuple[str, ...]) -> torch.export.ExportedProgram:
    """Decompose these ops (and the rest to Core ATen) if the graph has any."""
    present = {n.target for n in exported.graph.nodes if n.op == "call_function"}
    if not present & set(_ops(names)):
        return exported
    from torch._decomp import get_decompositions

    table = torch.export.default_decompositions()
    table.update(get_decompositions(_ops(names)))
    return exported.run_decompositions(table)


def _arguments(exported: torch.export.ExportedProgram) -> tuple[list, dict[str, torch.Tensor]]:
    """The compiled function's arguments in order — ["weight", name] or ["input", i] — and the
    weights by name: our constants (buffers of the export) and any constant the decompositions made."""
    from torch.export.graph_signature import InputKind

    order, weights, i = [], {}, 0
    for spec in exported.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            order.append(["input", i])
            i += 1
            continue
        value = exported.state_dict.get(spec.target)
        if value is None:
            value = exported.constants[spec.target]
        weights[spec.target] = value
        order.append(["weight", spec.target])
    return order, weights


def _mlir(exported: torch.export.ExportedProgram) -> bytes:
    """The graph as MLIR bytecode (torch dialect), every placeholder a function argument."""
    from iree.compiler import ir
    from iree.compiler.extras.fx_importer import FxImporter

    as_sdpa(zero_masked_rows(exported.graph))
    importer = FxImporter(context=ir.Context())
    importer.import_stateless_graph(exported.graph, func_name="main")
    unknown = sorted(set(re.findall(r'torch\.operator "torch\.([\w.]+)"', str(importer.module))))
    if unknown:
        raise NotImplementedError(f"IREE's importer has no lowering for {', '.join(unknown)}")
    out = io.BytesIO()
    importer.module.operation.write_bytecode(out)
    return out.getvalue()


class _Lease:
    """A device, held by the programs loaded on it. IREE's Vulkan device keeps two threads polling
    its queues (on Mesa's lavapipe: two cores busy for as long as the device lives, which slowed
    everything a process did after its first Vulkan program), so a Vulkan device lives only while
    a program holds it. The CPU device's workers sleep: it is kept for the process, as
    iree.runtime keeps devices (tensors handed to torch without a copy hold its buffers)."""

    def __init__(self, driver: str):
        import iree.runtime as rt

        os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # the Vulkan loader complains without one
        self.device = rt.get_device(driver, cache=driver != "vulkan")


_devices: dict[str, weakref.ref] = {}  # driver -> the lease its live programs share
_leasing = threading.Lock()


def _device(driver: str) -> _Lease:
    with _leasing:
        lease = _devices[driver]() if driver in _devices else None
        if lease is None:
            lease = _Lease(driver)
            _devices[driver] = weakref.ref(lease)
        return lease


class Iree:
    external_weights = True  # weights are arguments, uploaded once at load
    writes_in_place = False
    composites: frozenset[str] = frozenset()
    toolchain = ("iree-base-compiler", "iree-base-runtime")
    extension = "bin"
    calibrates = False
    dynamic = False  # static shapes: the partitioner leaves nodes whose sizes vary to eager

    def __init__(self, name: str, backend: str, driver: str, flags: tuple[str, ...] = (), decompose: tuple[str, ...] = ()):
        """`decompose`: ops this target's code generation lacks, besides BatchNorm's."""
        self.name, self.backend, self.driver, self.flags = name, backend, driver, flags
        self.decompose = _BATCH_NORM + decompose
        self._probe = Probe(self, f"{name}-ops", f"IREE ({backend})", self._try)

    def available(self) -> Availability:
        missing = [m for m in ("iree.compiler", "iree.runtime") if importlib.util.find_spec(m.split(".")[0]) is None
                   or importlib.util.find_spec(m) is None]
        if missing:
            return Availability("unavailable", f"missing {', '.join(missing)}", _HINT)
        # importing iree.runtime imports ml_dtypes for its dtype tables: 1.8 s here, most of what
        # `torchnative delegates` took. The native binding iree.runtime re-exports (and goes through
        # itself) lists the devices in 0.1 s
        from iree._runtime.libs import _runtime

        try:
            devices = _runtime.get_cached_hal_driver(self.driver).query_available_devices()
        except Exception as e:  # no Vulkan loader, no ICD
            return Availability("unavailable", f"IREE's {self.driver} driver did not start: {str(e).splitlines()[0]}",
                                _VULKAN_HINT if self.driver == "vulkan" else _HINT)
        if not devices:
            return Availability("unavailable", f"IREE's {self.driver} driver lists no device", _VULKAN_HINT)
        names = ", ".join(d["name"] for d in devices)
        if "llvmpipe" in names:
            return Availability("executes", f"software Vulkan ({names.split(' (')[0]}, Mesa lavapipe): results "
                                            "are the GPU path's, times are the CPU's; while a Vulkan program is loaded "
                                            "IREE's device polls its queues on two threads (two cores busy)")
        return Availability("executes", "" if self.driver.startswith("local") else names)

    def supports(self, node: fx.Node) -> Support:
        if not isinstance(node.target, torch._ops.OpOverload):
            return Support(False, f"{node.target} is not an aten op")
        for t in tensors(node):
            if t.dtype not in _DTYPES:
                return Support(False, f"{t.dtype} tensors are not compiled for {self.name}")
            if t.numel() == 0:
                return Support(False, "empty tensors: IREE's runtime rejects zero-size buffers")
        if node.target is torch.ops.aten.gelu.default and node.kwargs.get("approximate", "none") != "none":
            return Support(False, "IREE's tanh-approximated gelu differs from eager's by up to 5e-5 (OpInfo sweep)")
        return self._probe(node)

    def compile(self, graph: CapturedGraph) -> Artifact:
        from iree.compiler import compile_str

        exported = _decompose(graph.to_exported_program(dense=True), self.decompose)
        order, weights = _arguments(exported)
        vmfb = compile_str(_mlir(exported), target_backends=[self.backend], input_type="torch",
                           extra_args=list(self.flags))
        return Artifact(self.name, vmfb, {"arguments": order, "n_outputs": len(graph.output_roles)}, weights)

    def load(self, artifact: Artifact) -> Runner:
        import iree.runtime as rt

        lease = _device(self.driver)
        device = lease.device
        instance = rt.VmInstance()
        module = rt.VmModule.copy_buffer(instance, artifact.payload)
        context = rt.VmContext(instance, [rt.create_hal_module(instance, device), module])
        missing = [name for kind, name in artifact.meta["arguments"] if kind == "weight" and name not in artifact.constants]
        if missing:
            raise ValueError(f"the module takes weights {missing[:3]} that were not given to load")
        weights = {name: _upload(device, artifact.constants[name]) for kind, name in artifact.meta["arguments"] if kind == "weight"}
        order = [weights[name] if kind == "weight" else name for kind, name in artifact.meta["arguments"]]
        if self.driver == "vulkan":
            return _VulkanCall(lease, context, module, order)
        function = module.lookup_function("main")

        def run(inputs: list[torch.Tensor], _keep=(lease, instance, module, context)) -> list[torch.Tensor]:
            results = rt.VmVariantList(1)
            context.invoke(function, _arguments_list(device, order, inputs), results)
            # host-local buffers: handed to torch without a copy (the capsule keeps them alive)
            return [torch.utils.dlpack.from_dlpack(device.create_dlpack_capsule(results.get_as_object(i, rt.HalBufferView), 1, 0))
                    for i in range(len(results))]

        return run

    def _try(self, alone: CapturedGraph) -> None:
        from torchnative.delegates.probe import random_inputs

        self.load(self.compile(alone))(random_inputs(alone))


def _upload(device, t: torch.Tensor):
    import iree.runtime as rt
    from iree.runtime.array_interop import map_dtype_to_element_type

    a = t.detach().contiguous().numpy()
    return device.allocator.allocate_buffer_copy(memory_type=int(rt.MemoryType.DEVICE_LOCAL),
                                                 allowed_usage=int(rt.BufferUsage.DEFAULT), device=device,
                                                 buffer=a, element_type=map_dtype_to_element_type(a.dtype))


def _arguments_list(device, order: list, inputs: list[torch.Tensor], extra: int = 0):
    import iree.runtime as rt

    args = rt.VmVariantList(len(order) + extra)
    for a in order:
        args.push_ref((_upload(device, inputs[a]) if isinstance(a, int) else a).ref)
    return args


class _VulkanCall:
    """One call on a Vulkan device. Its output buffers cannot be mapped, and lavapipe refuses to
    import unaligned host memory (what `to_host()` does), so every output is copied into one
    host-visible staging buffer by a command buffer queued after the call, then read mapped."""

    def __init__(self, lease: _Lease, context, module, order: list):
        self.lease, self.device, self.context, self.module, self.order = lease, lease.device, context, module, order
        self.function = module.lookup_function("main$async")
        self.staging, self.size = None, 0

    def __del__(self) -> None:
        # what lives on the device goes before the device may (the last program on it: its lease)
        self.staging = self.order = self.function = self.context = self.module = self.device = None

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        import iree.runtime as rt

        semaphore = self.device.create_semaphore(0)
        args = _arguments_list(self.device, self.order, inputs, extra=2)
        args.push_ref(rt.HalFence.create_at(semaphore, 0).ref)  # wait: already signalled
        args.push_ref(rt.HalFence.create_at(semaphore, 1).ref)  # signalled when the call is done
        results = rt.VmVariantList(1)
        self.context.invoke(self.function, args, results)
        views = [results.get_as_object(i, rt.HalBufferView) for i in range(len(results))]
        offsets, total = [], 0
        for v in views:
            offsets.append(total)
            total += (v.get_buffer().byte_length() + 255) // 256 * 256
        if self.size < total:
            self.staging = self.device.allocator.allocate_buffer(
                memory_type=int(rt.MemoryType.HOST_LOCAL | rt.MemoryType.DEVICE_VISIBLE),
                allowed_usage=int(rt.BufferUsage.TRANSFER_TARGET | rt.BufferUsage.MAPPING_SCOPED),
                allocation_size=max(total, 256))
            self.size = max(total, 256)
        commands = rt.HalCommandBuffer(self.device)
        for v, offset in zip(views, offsets):
            if v.get_buffer().byte_length():
                commands.copy(v.get_buffer(), self.staging, 0, offset, v.get_buffer().byte_length())
        commands.end()
        self.device.queue_execute(commands, wait_semaphores=rt.HalFence.create_at(semaphore, 1),
                                  signal_semaphores=rt.HalFence.create_at(semaphore, 2))
        rt.HalFence.create_at(semaphore, 2).wait()  # raises if the device failed
        mapped = self.staging.map()
        flat = mapped.asarray([self.size], np.dtype(np.uint8))
        outs = []
        for v, offset in zip(views, offsets):
            dtype = np.dtype(rt.HalElementType.map_to_dtype(v.element_type))
            shape = list(v.shape)
            n = int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
            outs.append(torch.from_numpy(flat[offset:offset + n].copy().view(dtype).reshape(shape)))
        return outs


# the fused attention kernel has no SPIR-V code generation for the baseline Vulkan target
vulkan = Iree("vulkan", "vulkan-spirv", "vulkan", decompose=("_scaled_dot_product_flash_attention_for_cpu.default",))
cpu = Iree("iree-cpu", "llvm-cpu", "local-task", ("--iree-llvmcpu-target-cpu=host",))

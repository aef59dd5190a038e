"""XNNPACK through ExecuTorch: a Core ATen subgraph → ExportedProgram → Edge dialect lowered with
XnnpackPartitioner → .pte → the ExecuTorch runtime."""
from __future__ import annotations

import functools
import importlib.util

import torch
import torch.fx as fx

from torchnative import sizes
from torchnative.interface import YES, Artifact, Availability, Runner, Support
from torchnative.ir import CapturedGraph
from torchnative.quiet import native_notes_dropped, quiet

_HINT = "pip install executorch==1.5.1"
# our Core ATen view ops are the Edge dialect's *_copy ops
_EDGE_NAMES = {"view": "view_copy", "permute": "permute_copy", "unsqueeze": "unsqueeze_copy",
               "slice": "slice_copy", "_to_copy": "_to_dim_order_copy"}
@functools.cache
def _targets() -> frozenset[str]:
    """Edge op names ("addmm.default") that some XNNPACK partitioner config takes."""
    with quiet():
        from executorch.backends.xnnpack.partition.config import ALL_PARTITIONER_CONFIGS

    names = set()
    for config in ALL_PARTITIONER_CONFIGS:
        try:
            names.add(config().target_name)
        except Exception:
            continue
    return frozenset(names)


def _edge_name(op: torch._ops.OpOverload) -> str:
    name = op._schema.name.split("::")[1]
    return f"{_EDGE_NAMES.get(name, name)}.{op._overloadname}"


# claimed by a partitioner config, yet left to portable kernels in our graphs (seen on BERT, GPT-2,
# Llama, ViT); a fusion pass to `linear` would win them back
_DECLINED = frozenset({"addmm.default", "mm.default", "bmm.default", "pow.Tensor_Scalar", "mean.dim", "cat.default"})

# what may stay outside the XNNPACK blob: data movement the portable runtime does cheaply, and
# the integer arithmetic on sizes of a graph whose sizes vary (torchnative.sizes)
_CHEAP = ("view_copy", "permute_copy", "unsqueeze_copy", "squeeze_copy", "expand_copy", "slice_copy",
          "select_copy", "clone", "_to_dim_order_copy", "_clone_dim_order", "alias_copy",
          "sym_size", "<built-in function")


def _check_all_delegated(graph: fx.Graph) -> None:
    """ExecuTorch runs what XNNPACK declines with its portable kernels — naive loops, far slower
    than eager (an undelegated addmm made BERT-base crawl). Such a partition belongs to eager."""
    names = {str(n.target).split(">")[0].replace("<EdgeOpOverload: ", "") for n in graph.nodes if n.op == "call_function"}
    left = sorted(x for x in names if "executorch_call_delegate" not in x and "getitem" not in x
                  and not any(c in x for c in _CHEAP))
    if left:
        raise RuntimeError(f"XnnpackPartitioner left {', '.join(left)} to portable kernels")


class Xnnpack:
    name = "xnnpack"
    external_weights = False
    writes_in_place = False
    composites: frozenset[str] = frozenset()
    toolchain = ("executorch",)
    extension = "pte"
    calibrates = False
    dynamic = True  # dynamic dims with an upper bound: sizes.bucket

    def available(self) -> Availability:
        if importlib.util.find_spec("executorch") is None:
            return Availability("unavailable", "executorch is not installed", _HINT)
        return Availability("executes")

    def supports(self, node: fx.Node) -> Support:
        if not isinstance(node.target, torch._ops.OpOverload):
            return Support(False, f"{node.target} is not an aten op")
        if _edge_name(node.target) not in _targets():
            return Support(False, f"no XNNPACK kernel for {node.target}")
        if _edge_name(node.target) in _DECLINED:
            return Support(False, f"XnnpackPartitioner declines {node.target} in our graphs (weights arrive "
                                  "permuted, not as linear); it would run on ExecuTorch's portable kernels")
        for x in (node, *node.all_input_nodes):
            v = x.meta.get("val")
            if not isinstance(v, torch.Tensor):
                continue
            if v.dtype != torch.float32 and not (x is not node and not v.is_floating_point()):
                return Support(False, f"{v.dtype} tensors: XNNPACK takes float32 (and quantized) graphs")
            if v.numel() == 0:
                return Support(False, "empty tensors: the ExecuTorch runtime aborts on their strides")
        if node.target is torch.ops.aten.gelu.default and node.kwargs.get("approximate", "none") != "none":
            return Support(False, "XNNPACK's gelu is the exact (erf) one; tanh approximation differs")
        if node.target is torch.ops.aten.convolution.default and node.args[0].meta["val"].dim() != 4:
            return Support(False, "XNNPACK convolution is 2-D (4-D input) only")
        return YES

    def compile(self, graph: CapturedGraph) -> Artifact:
        with quiet():
            from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
            from executorch.exir import to_edge_transform_and_lower

        meta = {"n_inputs": graph.runtime_inputs(), "n_outputs": len(graph.output_roles)}
        bounds = {}
        if sizes.is_symbolic(graph.gm):
            # ExecuTorch plans memory for a symbol's largest size: this program takes sizes up to
            # the bucket of the size it was recorded at (the program cache builds one per bucket)
            graph = graph.copy()
            bounds = sizes.bounded(graph.gm)
        # dense: the runner passes contiguous inputs; a .pte exported for permuted ones (a RoPE
        # partition's q and k) takes them in that dim order, and XNNPACK refuses the contiguous ones
        exported = graph.to_exported_program(dense=True)
        ranges = sizes.exported_ranges(exported, graph.gm)
        with quiet():
            edge = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()])
            _check_all_delegated(edge.exported_program().graph_module.graph)
            program = edge.to_executorch()
        return Artifact(self.name, bytes(program.buffer), meta, ranges=ranges, bounds=sizes.narrowest(bounds))

    def load(self, artifact: Artifact) -> Runner:
        with quiet():
            from executorch.runtime import Runtime

        payload = artifact.payload
        program = Runtime.get().load_program(payload)
        with native_notes_dropped("[cpuinfo_utils.cpp:"):  # its CPU probe, on the first method loaded
            method = program.load_method("forward")
        # ExecuTorch crashes the process on a wrong input count; refuse such a program here
        takes = method.metadata.num_inputs()
        if takes != artifact.meta["n_inputs"]:
            raise RuntimeError(f"the .pte takes {takes} input(s), the subgraph passes {artifact.meta['n_inputs']}")
        execute = method.execute

        def runner(inputs: list[torch.Tensor], _keep=(payload, program, method)) -> list[torch.Tensor]:
            # _keep: the runtime reads the .pte bytes in place; they must outlive the method
            if any(t.numel() == 0 for t in inputs):  # ExecuTorch aborts the process on these
                raise RuntimeError("empty input tensor")
            return list(execute([t.detach().contiguous() for t in inputs]))

        return runner


delegate = Xnnpack()

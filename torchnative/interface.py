"""The delegate contract (DESIGN.md §5): small, like a device in tinygrad or a backend in
ExecuTorch. It sits left of the partitioner (which asks `supports`) and of the delegates (which
implement it), so neither imports the other for it. Each delegate module provides `Delegate`
instances."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Literal, Protocol

import torch
import torch.fx as fx

from torchnative.ir import CapturedGraph

Status = Literal["executes", "compile-only", "unavailable"]


@dataclass(frozen=True)
class Availability:
    status: Status
    reason: str = ""          # why not fully usable here
    install_hint: str = ""    # what to run to make it usable


@dataclass(frozen=True)
class Support:
    ok: bool
    reason: str = ""          # why not, when not

    def __bool__(self) -> bool:
        return self.ok


YES = Support(True)


@dataclass(frozen=True)
class Tolerance:
    """How far a delegate's partition may be from eager's and still be trusted (build/verify.py):
    "scale", the largest absolute error over the output's largest magnitude (float32 kernels that
    round otherwise), or "l2", the relative L2 error (quantized activations, float16); a float
    output's magnitude counts as at least 1e-3 (build/verify.py)."""
    kind: Literal["scale", "l2"]
    bound: float
    why: str


FLOAT32 = Tolerance("scale", 1e-4, "float32 kernels: rounding over a partition's chains of ops stays well below it")
# float64 throughout: kernels that compute in float64 round at ~1e-16; a translation that rounds a
# constant to float32 (torchlib's tanh GELU: 6e-9) or a kernel that computes in float32 (1e-7) is a
# precision the user did not ask for
FLOAT64 = Tolerance("scale", 1e-10, "float64 kernels: a partition that computes anything in float32 is further off")
# float16/bfloat16 values (eps 1e-3, 8e-3): a kernel that computes in float32 and rounds once
# differs from eager's rounding per op by a few of those
HALF = Tolerance("scale", 3e-2, "float16/bfloat16 arithmetic: a kernel rounds once where eager rounds per op")


@dataclass
class Artifact:
    """What `compile` produces: serializable bytes plus what `load` needs to run them. A delegate
    whose payload names weights instead of holding them (`external_weights`) lists them in
    `constants`; whoever stores the payload (a bundle, the disk cache) stores or finds those
    separately and hands them back to `load`. `meta` is the delegate's own (JSON); `ranges` and
    `bounds` are what the runtime reads: per symbol of a graph whose sizes vary (torchnative.sizes),
    the sizes its artifact takes (torch.export found them narrower than the graph's rules) and the
    sizes it was built for (a program per bucket, sizes.bucket)."""
    delegate: str
    payload: bytes
    meta: dict = field(default_factory=dict)
    constants: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    ranges: dict[int, tuple[int, int]] = field(default_factory=dict)
    bounds: dict[int, tuple[int, int]] = field(default_factory=dict)
    # an object of this process that `load` runs in place of the payload (eager's and candle's
    # graph): an artifact with one is never stored (disk cache, bundle)
    live: Any = field(default=None, repr=False)


# inputs -> outputs, new tensors; an output the graph marks "written_back" (ir.OutputRole) may be
# a buffer the runner reuses on every call: the caller copies it out before the next call
Runner = Callable[[list[torch.Tensor]], list[torch.Tensor]]


class CompileOnly(RuntimeError):
    """`load` of a delegate whose artifacts are built here but run elsewhere (Core ML on Linux):
    the partition keeps its artifact (a bundle ships it) and runs on eager here, with this reason."""


class Delegate(Protocol):
    name: str
    external_weights: bool  # artifacts refer to baked weights by name (Artifact.constants)
    composites: frozenset[str]  # fusions (passes.fuse.COMPOSITES) it maps to one kernel, applied before compile
    # runs the state updates of passes.state (aten.index_put_ of a state input) on the caller's
    # tensor itself; the partitioner leaves them to eager for a delegate that does not
    writes_in_place: bool
    calibrates: bool  # compile wants graph.samples: activation ranges come from real values
    # compiles graphs whose sizes vary (torchnative.sizes) for every size; the partitioner leaves
    # the nodes whose sizes vary to eager for a delegate that does not say it does
    dynamic: bool
    # takes a graph's scalar inputs (Python floats that change between calls, recording/scalars.py)
    # as runtime inputs, and says in `supports` where; the partitioner leaves their readers to
    # eager for a delegate that does not say it does
    scalar_inputs: bool
    toolchain: tuple[str, ...]  # the packages its artifacts are made and run with (cache keys, manifests)
    extension: str  # a bundle's file name ending for its artifacts ("" when they cannot be saved)

    def available(self) -> Availability: ...

    def supports(self, node: fx.Node) -> Support: ...

    def compile(self, graph: CapturedGraph) -> Artifact: ...

    def load(self, artifact: Artifact) -> Runner: ...

    # optional: `prepare()`, what its compiles need once per process (imports, tables), run on the
    # background compile thread when a model is accelerated (cache/program_cache.prepare)
    # optional: `tolerance(graph) -> Tolerance` for a partition's graph (default FLOAT32)

"""The delegate interface (DESIGN.md §5): small, like a device in tinygrad or a backend in
ExecuTorch. Each delegate module provides one `Delegate` instance."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
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


def tensors(node: fx.Node):
    """The tensors a node computes and reads (as traced): what a delegate's dtype and shape rules look at."""
    for x in (node, *node.all_input_nodes):
        v = x.meta.get("val")
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                yield t


@dataclass
class Artifact:
    """What `compile` produces: serializable bytes plus what `load` needs to run them. A delegate
    whose payload names weights instead of holding them (`external_weights`) lists them in
    `constants`; whoever stores the payload (a bundle, the disk cache) stores or finds those
    separately and hands them back to `load`."""
    delegate: str
    payload: bytes
    meta: dict = field(default_factory=dict)    # JSON-serializable, except the in-memory-only eager/candle
    constants: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)


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

    def available(self) -> Availability: ...

    def supports(self, node: fx.Node) -> Support: ...

    def compile(self, graph: CapturedGraph) -> Artifact: ...

    def load(self, artifact: Artifact) -> Runner: ...


_compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchnative-compile")


def in_clean_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the compile thread. A cut flushes from inside __torch_dispatch__, where torch
    has excluded the Python dispatch key for this thread; tracing compilers (torch.export) need it,
    so compiles run on a thread whose dispatch state is fresh. Called on that thread, runs there."""
    if threading.current_thread().name.startswith("torchnative-compile"):
        return fn(*args)  # the single worker waiting on itself would never return
    return _compiler.submit(fn, *args).result()

"""What delegates share beyond the contract (`torchnative.interface`): the tensors a node touches,
and the thread compiles run on."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.fx as fx

from torchnative import threads
from torchnative.interface import Support
from torchnative.passes.state import SLICE_UPDATE
from torchnative.delegates.onnx_export import slice_write


def state_or_aten(node: fx.Node, state: str) -> Support | None:
    """What a delegate that keeps written inputs as its own states (Core ML's, Core AI's) says of
    a state update (passes.state) and of a node that is not an aten op; None for the rest."""
    if node.target is SLICE_UPDATE:
        if node.args[0].op != "placeholder" or not slice_write(node):
            return Support(False, f"a state update is a {state} only when it writes a graph input along one dim by "
                                  f"a 1-D integer index")
        return Support(True)
    if not isinstance(node.target, torch._ops.OpOverload):
        return Support(False, f"{node.target} is not an aten op")
    return None


def tensors(node: fx.Node):
    """The tensors a node computes and reads (as traced): what a delegate's dtype and shape rules look at."""
    for x in (node, *node.all_input_nodes):
        v = x.meta.get("val")
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                yield t


_fresh = threading.local()


def fresh_dispatch_state() -> None:
    """Mark this thread as one that runs compiles only, its dispatch state fresh (a thread pool's
    initializer: the compile thread here, the background compiles' in the program cache)."""
    _fresh.yes = True


_compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchnative-compile", initializer=fresh_dispatch_state)
# torch.export and make_fx keep state per process (fx's CURRENT_PATCHER, the proxy modes): two
# threads tracing at once (an in-call compile beside a background one) fail each other with errors
# like "Trying to pop empty mode stack", which a probe would then keep as a verdict on the op
_tracing = threading.RLock()
_tracer: int | None = None  # the thread that holds _tracing


def traced(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` as the one trace (or export) of the process at a time (`_tracing`)."""
    global _tracer
    with _tracing:
        outer, _tracer = _tracer, threading.get_ident()
        try:
            return fn(*args)
        finally:
            _tracer = outer


def _is_exporting() -> bool:
    """`torch.compiler.is_exporting()` for the thread that asks. torch.export sets a process-wide
    flag: a user's forward that ran while a compile thread exported took export's paths
    (transformers' masks skip nothing when `is_exporting()`), so a decode step recorded other
    graphs — others to compile, none to replay — whenever a compile ran beside it."""
    return torch.compiler._is_exporting_flag and (_tracer is None or _tracer == threading.get_ident())


torch.compiler.is_exporting = _is_exporting


def _remember_cia_ops() -> None:
    """torch.export's `_collect_all_valid_cia_ops` (every run_decompositions asks it, several
    times: each ONNX Runtime, XNNPACK, IREE or Core ML compile), remembered on the compile thread
    while the dispatcher's composite registrations and op namespaces stay as they were. torch
    walks every namespace again on each call, materializing all ~840 composite ops per namespace:
    ~0.1 s each time here. Other threads (a user's own export) get torch's function as it is."""
    from torch._export import utils
    from torch.export import decomp_utils, exported_program

    collect, memo = utils._collect_all_valid_cia_ops, {}

    def collect_once() -> Any:
        if _tracer != threading.get_ident():
            return collect()
        key = (len(torch._C._dispatch_get_registrations_for_dispatch_key("CompositeImplicitAutograd")),
               tuple(torch.ops._dir))
        if key not in memo:
            memo.clear()
            memo[key] = frozenset(collect())
        return memo[key]

    exported_program._collect_all_valid_cia_ops = decomp_utils._collect_all_valid_cia_ops = collect_once


_remember_cia_ops()


def in_clean_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on a thread whose dispatch state is fresh. A cut flushes from inside
    __torch_dispatch__, where torch has excluded the Python dispatch key for this thread; tracing
    compilers (torch.export) need it, so compiles run on the compile thread, or where they are
    (a thread marked by `fresh_dispatch_state`: the compile thread itself, which waiting on
    itself would never return, or the background compiles'). One traces at a time."""
    if getattr(_fresh, "yes", False):
        return traced(fn, *args)
    # with one torch thread: a thread that ran a parallel op with two keeps an OpenMP team for good,
    # and once libgomp manages more threads than cores it throttles every team's spin, so the
    # caller's workers sleep between regions: every eager op of the process after the first
    # in-call build ran slower (an RT-DETR ActMAD step 36 -> 72 ms, a 256x256 mm 156 -> 235 µs)
    return _compiler.submit(threads.on_one_thread(traced, threads.for_programs()), fn, *args).result()

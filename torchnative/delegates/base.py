"""What delegates share beyond the contract (`torchnative.interface`): the tensors a node touches,
and the thread compiles run on."""
from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import torch
import torch.fx as fx


def tensors(node: fx.Node):
    """The tensors a node computes and reads (as traced): what a delegate's dtype and shape rules look at."""
    for x in (node, *node.all_input_nodes):
        v = x.meta.get("val")
        for t in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(t, torch.Tensor):
                yield t


_compiler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="torchnative-compile")


def in_clean_thread(fn: Callable[..., Any], *args: Any) -> Any:
    """`fn(*args)` on the compile thread. A cut flushes from inside __torch_dispatch__, where torch
    has excluded the Python dispatch key for this thread; tracing compilers (torch.export) need it,
    so compiles run on a thread whose dispatch state is fresh. Called on that thread, runs there."""
    if threading.current_thread().name.startswith("torchnative-compile"):
        return fn(*args)  # the single worker waiting on itself would never return
    return _compiler.submit(fn, *args).result()

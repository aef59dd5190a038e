"""A background build's delegate compiles run in a child process.

A compile is seconds of Python (torch.export, the toolchain's translation). On the background
thread it holds the GIL between the caller's ops, and every op of the caller's next calls waits
for it: beside a thread that runs Python, a 600-op fast-weight forward took 33 ms instead of 6
with the switch interval at 0.1 ms, 190 ms at 1 ms (measured here, 2 cores). A fork of the process
has the graph and the weights it bakes without copying them, compiles on its own interpreter
(niced: the caller's calls come first) and hands back the artifact's bytes; loading and checking
it (build/verify.py) stay here. A converter that crashes ends the child, not the user's process.

`TORCHNATIVE_COMPILE_PROCESS=0` keeps compiles on the background thread.
"""
from __future__ import annotations

import gc
import importlib._bootstrap
import os
import pickle
import select
import signal
import sys
import threading
import time
from typing import Callable

import torch

from torchnative.interface import Artifact

ENABLED = os.environ.get("TORCHNATIVE_COMPILE_PROCESS", "1") == "1" and hasattr(os, "fork")
# a child that has not answered by then is stopped, and its partition runs on eager (a compile
# of GPT-2 small for ONNX Runtime takes ~30 s here)
TIMEOUT = 1800.0

_local = threading.local()
_children: set[int] = set()


def mark() -> None:
    """Compiles asked for on this thread (the background builds') run in a child process."""
    _local.apart = True


def wanted() -> bool:
    return ENABLED and getattr(_local, "apart", False)


def _no_import_under_way(limit: float = 10.0) -> None:
    """Wait (up to `limit` seconds) until no other thread is importing a module. A fork while one
    is leaves the child that module half run and its lock held by a thread the child does not
    have: the child's own import of it waited forever (a TENT step's backward imported torch.export
    modules on the caller's thread while a build forked)."""
    me, deadline = threading.get_ident(), time.monotonic() + limit
    while time.monotonic() < deadline:
        locks = [ref() for ref in list(importlib._bootstrap._module_locks.values())]
        if not any(lock is not None and lock.count and lock.owner not in (None, me) for lock in locks):
            return
        sys.setswitchinterval(1e-4)  # let the importer run
        time.sleep(0.005)
        sys.setswitchinterval(1.0)


def compiled(compile: Callable[[], Artifact], constants: dict[str, torch.Tensor]) -> Artifact | None:
    """`compile()` run in a fork of this process; its artifact, whose constants are `constants`'
    tensors where the compile kept them. None: the artifact is an object of the child (a live
    graph, which only this process can make)."""
    r, w = os.pipe()
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1.0)  # no other thread starts an import between the look and the fork
    try:
        _no_import_under_way()
        pid = os.fork()
    finally:
        sys.setswitchinterval(switch)
    if pid == 0:  # the child: it never returns
        os.close(r)
        _child(compile, constants, w)
    os.close(w)
    _children.add(pid)
    try:
        data = _read(r, pid)
    finally:
        os.close(r)
        _, status = os.waitpid(pid, 0)
        _children.discard(pid)
    if not data:
        raise RuntimeError(f"the compile process ended without an artifact ({_ended(status)})")
    kind, *rest = pickle.loads(data)
    if kind == "error":
        raise rest[0]
    if kind == "live":
        return None
    delegate, payload, meta, kept, ranges, bounds = rest
    return Artifact(delegate, payload, meta, {n: constants[n] if t is None else t for n, t in kept.items()},
                    ranges, bounds)


def _child(compile: Callable[[], Artifact], constants: dict, w: int) -> None:
    try:
        # the parent's objects are never collected here: one that held threads (an ONNX Runtime
        # session's pool, garbage when the parent forked) waited in its destructor for threads
        # this process does not have
        gc.freeze()
        os.nice(10)
        torch.set_num_threads(1)  # the parent's OpenMP team is not in this process either
        sys.settrace(None)  # the compile thread's slices (cache/program_cache.py): no caller here
        _own_locks()
        artifact = compile()
        if artifact.live is not None:
            out: tuple = ("live",)
        else:
            kept = {n: None if constants.get(n) is t else t for n, t in artifact.constants.items()}
            out = ("ok", artifact.delegate, artifact.payload, artifact.meta, kept, artifact.ranges, artifact.bounds)
        data = pickle.dumps(out, protocol=pickle.HIGHEST_PROTOCOL)
    except BaseException as e:  # noqa: BLE001 - whatever failed is the parent's to report
        data = _error(e)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(w, view):]
    finally:
        os._exit(0)  # not the parent's exit hooks, nor its threads' joins


def _own_locks() -> None:
    """Locks of the parent's a thread it had may have held at the fork, which nothing here would
    release: tqdm's (torch.export's fx interpreter makes a progress bar; tqdm's monitor thread
    takes the lock every few seconds): a child forked meanwhile waited for it until the timeout,
    and the caller's next build with it."""
    std = sys.modules.get("tqdm.std")
    if std is not None:
        std.tqdm.set_lock(threading.RLock())  # this process has one thread


def _error(e: BaseException) -> bytes:
    try:
        return pickle.dumps(("error", e))
    except Exception:  # an exception that does not pickle: its type and message
        return pickle.dumps(("error", RuntimeError(f"{type(e).__name__}: {e}")))


def _read(fd: int, pid: int) -> bytes:
    chunks, deadline = [], time.monotonic() + TIMEOUT
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            os.kill(pid, signal.SIGKILL)
            raise TimeoutError(f"the compile process gave no artifact in {TIMEOUT:.0f} s")
        if select.select([fd], [], [], min(left, 5.0))[0]:
            chunk = os.read(fd, 1 << 20)
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)


def _ended(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"killed by {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit status {os.WEXITSTATUS(status)}"


def _stop_children() -> None:
    for pid in list(_children):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# at exit, a compile still running in a child is stopped (its thread then ends; an exit waits for it)
threading._register_atexit(_stop_children)

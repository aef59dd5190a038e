"""Notes dependencies print for their own developers, kept from the user; everything else reaches
them.

Two kinds. Notes any process that imports them would print, dropped by their text wherever they
come from (`install`, when torchnative is imported): torchao (which executorch and transformers
import, transformers lazily, when a model is built) logs each CUDA kernel library a CPU build
cannot load and its enums registered as pytree constants, which torch deprecates; torch warns
about its own `LeafSpec` when it copies an exported program. And what a toolchain says while it
works for us (coremltools' passes and progress bars, onnxruntime.quantization's advice, the
exporters' warnings, coreai-torch's progress on stdout), dropped only for the thread inside `quiet()`: compiles run beside the user's
code, and the warnings, log records and stderr lines that code writes meanwhile are theirs.
`native_notes_dropped` does the same for a native library that writes to file descriptor 2.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import tempfile
import threading
import warnings
from typing import Iterator

_IMPORT_NOTES = {"torchao": "Failed to load ",
                 "torch.utils._pytree": "%s is an Enum subclass and is now natively supported by torch.compile"}
_TORCH_NOTES = [(FutureWarning, r"`isinstance\(treespec, LeafSpec\)` is deprecated")]

_local = threading.local()
_lock = threading.Lock()
_quiet_threads = 0  # threads inside quiet(): the handler filters and the stderr router are in place while any is
_attached: list[logging.Handler] = []
_native_lock = threading.Lock()


def _is_quiet() -> bool:
    return getattr(_local, "depth", 0) > 0


def _drop_import_note(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(_IMPORT_NOTES[record.name])


def _drop_quiet_thread(record: logging.LogRecord) -> bool:
    return not _is_quiet()  # a handler runs in the thread that logged


# the one function every warning is shown through: `catch_warnings` (pytest's, a user's
# `record=True`) replaces `showwarning` and its implementation, never this
_original_showwarnmsg = warnings._showwarnmsg  # type: ignore[attr-defined]


def _showwarnmsg(message: warnings.WarningMessage) -> None:
    if not _is_quiet():
        _original_showwarnmsg(message)


class _Router:
    """sys.stderr and sys.stdout while a thread is quiet: that thread's writes (tqdm and rich
    progress bars) go nowhere, others' through."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text: str) -> int:
        return len(text) if _is_quiet() else self.stream.write(text)

    def __getattr__(self, name: str):
        return getattr(self.stream, name)


def install() -> None:
    """Drop the import notes from now on (idempotent)."""
    for name in _IMPORT_NOTES:
        logger = logging.getLogger(name)
        if _drop_import_note not in logger.filters:
            logger.addFilter(_drop_import_note)
    for category, message in _TORCH_NOTES:
        warnings.filterwarnings("ignore", message=message, category=category)
    global _original_showwarnmsg
    if warnings._showwarnmsg is not _showwarnmsg:  # type: ignore[attr-defined]
        _original_showwarnmsg = warnings._showwarnmsg  # type: ignore[attr-defined]
        warnings._showwarnmsg = _showwarnmsg  # type: ignore[attr-defined]


def _handlers() -> list[logging.Handler]:
    """Where a dependency's records end: the root's handlers (or the last resort) and those of
    loggers that keep theirs (torch's)."""
    # copied in one step: another thread may make a logger while this looks at them
    every = list(logging.Logger.manager.loggerDict.values())
    loggers = [logging.getLogger(), *(v for v in every if isinstance(v, logging.Logger) and v.handlers)]
    return list({id(h): h for lg in loggers for h in lg.handlers}.values()) + [logging.lastResort]


def _enter() -> None:
    global _quiet_threads
    with _lock:
        _quiet_threads += 1
        if _quiet_threads == 1:
            _attached[:] = [h for h in _handlers() if h is not None]
            for h in _attached:
                h.addFilter(_drop_quiet_thread)
            sys.stderr, sys.stdout = _Router(sys.stderr), _Router(sys.stdout)


def _exit() -> None:
    global _quiet_threads
    with _lock:
        _quiet_threads -= 1
        if _quiet_threads == 0:
            for h in _attached:
                h.removeFilter(_drop_quiet_thread)
            _attached.clear()
            if isinstance(sys.stderr, _Router):  # unless the user replaced it meanwhile
                sys.stderr = sys.stderr.stream
            if isinstance(sys.stdout, _Router):
                sys.stdout = sys.stdout.stream


@contextlib.contextmanager
def quiet() -> Iterator[None]:
    """The warnings, log records and stderr writes of this thread are dropped inside; other
    threads' are not. Re-entrant."""
    depth = getattr(_local, "depth", 0)
    _local.depth = depth + 1
    if depth == 0:
        _enter()
    try:
        yield
    finally:
        _local.depth = depth
        if depth == 0:
            _exit()


@contextlib.contextmanager
def native_notes_dropped(*prefixes: str) -> Iterator[None]:
    """File descriptor 2 collected while the block runs; its lines that start with one of
    `prefixes` dropped, the rest (whoever wrote them) written to stderr after it."""
    with _native_lock, tempfile.TemporaryFile() as collected:
        sys.stderr.flush()
        saved = os.dup(2)
        os.dup2(collected.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            collected.seek(0)
            kept = [line for line in collected.read().decode(errors="replace").splitlines(keepends=True)
                    if not line.startswith(prefixes)]
            if kept:
                sys.stderr.write("".join(kept))

"""Compiled partitions on disk, so that a second process starts warm (DESIGN.md §6).

An entry is one file named by the hash of everything its artifact depends on: the partition's
graph key, the delegate, the contents of the weights it bakes in, and the versions of torchnative,
torch and the delegate's toolchain. It holds a JSON header (the artifact's metadata, size and
sha256) and the payload. Entries are written to a temporary file and renamed into place, so two
processes sharing the directory see a whole entry or none; an entry whose size or hash is wrong,
or whose artifact fails to load, is deleted and rebuilt, never trusted.
"""
from __future__ import annotations

import functools
import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Sequence

import torch
import torch.fx as fx

from torchnative import events
from torchnative.delegates import toolchain
from torchnative.delegates.base import Artifact, Delegate
from torchnative.ir import CapturedGraph
from torchnative.partitioner import Partition, Plan

_FORMAT = 1
_dir: Path | None | bool = True  # True: not chosen yet (environment or XDG default); None: off


def default_dir() -> Path | None:
    """$TORCHNATIVE_CACHE_DIR ("off" disables), else $XDG_CACHE_HOME/torchnative, else ~/.cache/torchnative."""
    chosen = os.environ.get("TORCHNATIVE_CACHE_DIR")
    if chosen is not None:
        return None if chosen in ("", "off", "0") else Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchnative"


def directory() -> Path | None:
    global _dir
    if _dir is True:
        _dir = default_dir()
    return _dir


def set_directory(path: str | os.PathLike | None) -> None:
    """Where compiled partitions are kept across processes; None turns the disk cache off."""
    global _dir
    _dir = Path(path) if path is not None else None


@functools.cache
def _toolchain(*delegates: str) -> str:
    return json.dumps(toolchain(set(delegates)), sort_keys=True)


def key(delegate: Delegate, graph: CapturedGraph) -> str:
    """Graph, delegate, toolchain, the baked weights' values unless the artifact holds none, and
    the calibration samples of a delegate that calibrates."""
    h = hashlib.sha256(f"{_FORMAT}\0{delegate.name}\0{graph.key}\0{_toolchain(delegate.name)}".encode())
    for name in sorted(graph.constants):
        t = graph.constants[name]
        h.update(f"\0{name}{t.dtype}{tuple(t.shape)}".encode())
        if t.numel() and not delegate.external_weights:
            h.update(_bytes(t))
    for values in graph.samples or ():  # a calibrating delegate's artifact depends on the values it saw
        for t, role in zip(values, graph.input_roles):
            # weights are the same tensors in every set, hashed once above
            if role not in ("param", "constant") and isinstance(t, torch.Tensor) and t.numel():
                h.update(_bytes(t))
    return h.hexdigest()


def _bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def _count(what: str) -> None:
    events.STATS.disk_cache[what] += 1


def get(entry: str, delegate: str, constants: dict[str, torch.Tensor]) -> Artifact | None:
    """The stored artifact, its external weights taken from `constants` (the graph's)."""
    folder = directory()
    if folder is None:
        return None
    path = folder / f"{entry}.entry"
    try:
        with open(path, "rb") as f:
            header = json.loads(f.readline())
            payload = f.read()
    except FileNotFoundError:
        _count("misses")
        return None
    except (OSError, ValueError):
        header, payload = None, b""
    if (not isinstance(header, dict) or header.get("delegate") != delegate or len(payload) != header.get("bytes")
            or hashlib.sha256(payload).hexdigest() != header.get("sha256")):
        discard(entry)
        return None
    _count("hits")
    return Artifact(delegate, payload, header["meta"], constants)


def discard(entry: str) -> None:
    """A corrupt entry (or one whose artifact failed to load): removed, to be rebuilt."""
    _discard(f"{entry}.entry")


def _discard(name: str) -> None:
    _count("corrupt")
    folder = directory()
    if folder is not None:
        (folder / name).unlink(missing_ok=True)


def put(entry: str, artifact: Artifact) -> None:
    folder = directory()
    if folder is None:
        return
    try:
        header = json.dumps({"delegate": artifact.delegate, "meta": artifact.meta, "bytes": len(artifact.payload),
                             "sha256": hashlib.sha256(artifact.payload).hexdigest()})
    except TypeError:  # the delegate keeps Python objects in its artifacts (candle): memory only
        _count("not cacheable")
        return
    _write(folder, f"{entry}.entry", header.encode() + b"\n" + artifact.payload)


def _write(folder: Path, name: str, data: bytes) -> None:
    """Whole or not at all: written beside, then renamed over (atomic on POSIX)."""
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name[:16]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / name)
        _count("writes")
    except OSError as e:  # a full or read-only disk costs the next process a compile, nothing more
        _count(f"write failed: {type(e).__name__}")
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


def plan_key(graph: CapturedGraph, delegates: Sequence[Delegate]) -> str:
    names = tuple(d.name for d in delegates)
    return hashlib.sha256(f"{_FORMAT}\0plan\0{names}\0{graph.key}\0{_toolchain(*names)}".encode()).hexdigest()


def get_plan(entry: str, graph: fx.Graph) -> Plan | None:
    """A partitioning stored by an earlier process: asking every delegate about every node again
    costs seconds (ONNX Runtime's translation table alone takes 1.7 s to build)."""
    folder = directory()
    if folder is None:
        return None
    try:
        stored = json.loads((folder / f"{entry}.plan").read_text())
        nodes = {n.name: n for n in graph.nodes}
        plan = Plan([Partition(d, tuple(nodes[n] for n in names)) for d, names in stored["partitions"]],
                    {n: [tuple(r) for r in reasons] for n, reasons in stored["declined"].items()})
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError):
        _discard(f"{entry}.plan")
        return None
    _count("plan hits")
    return plan


def put_plan(entry: str, plan: Plan) -> None:
    folder = directory()
    if folder is None:
        return
    text = json.dumps({"partitions": [(p.delegate, [n.name for n in p.nodes]) for p in plan.partitions],
                       "declined": plan.declined})
    _write(folder, f"{entry}.plan", text.encode())


_tables: dict[str, dict] = {}


def table(name: str, delegate: str) -> dict:
    """A small JSON table kept across processes (a delegate's answers about which ops it takes),
    valid for the current toolchain of `delegate`."""
    if name not in _tables:
        _tables[name] = {}
        folder = directory()
        path = folder / _table_file(name, delegate) if folder is not None else None
        if path is not None and path.exists():
            try:
                _tables[name] = json.loads(path.read_text())
            except (OSError, ValueError):
                _discard(path.name)
    return _tables[name]


def remember(name: str, delegate: str, key: str, value) -> None:
    table(name, delegate)[key] = value
    folder = directory()
    if folder is not None:
        _write(folder, _table_file(name, delegate), json.dumps(_tables[name]).encode())


def _table_file(name: str, delegate: str) -> str:
    return f"{name}-{hashlib.sha256(_toolchain(delegate).encode()).hexdigest()[:16]}.json"

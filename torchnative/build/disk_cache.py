"""Compiled partitions kept across processes, so that a second process (or another machine sharing
a bucket) starts warm (DESIGN.md §6).

An entry is one object (store.py: a file, or an object in a shared bucket) named by the hash of
everything its artifact depends on: the partition's graph key, the delegate, the contents of the
weights it bakes in, and the versions of torchnative, torch and the delegate's toolchain. It holds a JSON header (the artifact's metadata, size and
sha256) and the payload. Processes sharing the place see a whole entry or none; an entry whose size or
hash is wrong, or whose artifact fails to load, is deleted and rebuilt, never trusted.
"""
from __future__ import annotations

import hashlib
import json
from typing import Sequence

import torch
import torch.fx as fx

from torchnative import store
from torchnative.interface import Artifact, Delegate
from torchnative.ir import CapturedGraph, is_weight
from torchnative.partitioner import Partition, Plan
from torchnative.sizes import narrowest
from torchnative.toolchain import fingerprint

_FORMAT = 3  # 2: ranges and bounds are the artifact's own fields; 3: HTP artifacts without Reciprocal


def _toolchain(*delegates: Delegate) -> str:
    return fingerprint(tuple(sorted({p for d in delegates for p in d.toolchain})))


def key(delegate: Delegate, graph: CapturedGraph) -> str:
    """Graph, delegate, toolchain, the baked weights' values unless the artifact holds none, and
    the calibration samples of a delegate that calibrates."""
    h = hashlib.sha256(f"{_FORMAT}\0{delegate.name}\0{graph.key}\0{_toolchain(delegate)}".encode())
    for name in sorted(graph.constants):
        t = graph.constants[name]
        h.update(f"\0{name}{t.dtype}{tuple(t.shape)}".encode())
        if t.numel() and not delegate.external_weights:
            h.update(_bytes(t))
    for values in graph.samples or ():  # a calibrating delegate's artifact depends on the values it saw
        for t, role in zip(values, graph.input_roles):
            # weights are the same tensors in every set, hashed once above
            if not is_weight(role) and isinstance(t, torch.Tensor) and t.numel():
                h.update(_bytes(t))
    return h.hexdigest()


def _bytes(t: torch.Tensor):
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().data


def get(entry: str, delegate: str, constants: dict[str, torch.Tensor]) -> Artifact | None:
    """The stored artifact, its external weights taken from `constants` (the graph's)."""
    stored = store.read(f"{entry}.entry")
    if stored is None:
        store.count("misses")
        return None
    header, payload = stored
    if header.get("delegate") != delegate:
        discard(entry)
        return None
    store.count("hits")
    return Artifact(delegate, payload, header["meta"], constants, narrowest(header["ranges"]), narrowest(header["bounds"]))


def discard(entry: str) -> None:
    """A corrupt entry (or one whose artifact failed to load): removed, to be rebuilt, and its
    verdict with it (the rebuilt artifact is checked again)."""
    store.discard(f"{entry}.entry")
    store.remove(f"{entry}.verdict")


def put(entry: str, artifact: Artifact) -> None:
    if store.place() is None:
        return
    if artifact.live is not None:  # the delegate runs a Python object of this process (candle): memory only
        store.count("not cacheable")
        return
    store.write(f"{entry}.entry", artifact.payload, delegate=artifact.delegate, meta=artifact.meta,
                ranges=artifact.ranges, bounds=artifact.bounds)


def get_verdict(entry: str) -> dict | None:
    """The check's verdict on this artifact (build/verify.py), as an earlier process stored it."""
    stored = store.read(f"{entry}.verdict")
    if stored is None:
        return None
    try:
        verdict = json.loads(stored[1])
    except ValueError:
        verdict = None
    if not isinstance(verdict, dict):
        store.discard(f"{entry}.verdict")
        return None
    return verdict


def put_verdict(entry: str, verdict: dict) -> None:
    store.write(f"{entry}.verdict", json.dumps(verdict).encode())


def plan_key(graph: CapturedGraph, delegates: Sequence[Delegate]) -> str:
    names = tuple(d.name for d in delegates)
    return hashlib.sha256(f"{_FORMAT}\0plan\0{names}\0{graph.key}\0{_toolchain(*delegates)}".encode()).hexdigest()


def get_plan(entry: str, graph: fx.Graph) -> Plan | None:
    """A partitioning stored by an earlier process: asking every delegate about every node again
    costs seconds (ONNX Runtime's translation table alone takes 1.7 s to build)."""
    stored = store.read(f"{entry}.plan")
    if stored is None:
        return None
    try:
        text = json.loads(stored[1])
        nodes = {n.name: n for n in graph.nodes}
        plan = Plan([Partition(d, tuple(nodes[n] for n in names)) for d, names in text["partitions"]],
                    {n: [tuple(r) for r in reasons] for n, reasons in text["declined"].items()})
    except (ValueError, KeyError, TypeError):
        store.discard(f"{entry}.plan")
        return None
    store.count("plan hits")
    return plan


def put_plan(entry: str, plan: Plan) -> None:
    text = json.dumps({"partitions": [(p.delegate, [n.name for n in p.nodes]) for p in plan.partitions],
                       "declined": plan.declined})
    store.write(f"{entry}.plan", text.encode())

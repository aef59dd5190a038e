"""What a replay trace is valid for (replay/replayer.py): the guard key of a call.

A call's key is its argument structure, each tensor argument's metadata, each scalar's value,
each other object's identity and Python state, and the grad mode, the training flags of the
model and its submodules (DUA puts the BatchNorms alone in train mode for one call, the whole
model in eval for the next) and the default dtype. An object's state (a StaticCache: its layers, their tensors and counters) is a walk of its
fields; a `Snapshot` of what the walk read makes checking that it is unchanged cheaper than the
walk, which ran on every call of a decode step.
"""
from __future__ import annotations

import dataclasses
from collections import OrderedDict
from typing import Any

import torch
from torch.utils import _pytree as pytree

from torchnative.shim import LazyTensor
from torchnative.sizes import Flat, meta_ints

SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


def is_plain(spec: Any) -> bool:
    """Only plain containers and transformers' ModelOutput dataclasses (an encoder's outputs
    handed to each decode call): any other pytree-registered object, such as a KV cache, has
    state that Python updates."""
    if spec.is_leaf():
        return True
    ok = spec.type in (tuple, list, dict) or (issubclass(spec.type, OrderedDict) and dataclasses.is_dataclass(spec.type))
    return ok and all(is_plain(c) for c in spec.children())


def object_state(x: Any, depth: int = 5, read: "Snapshot | None" = None, place: tuple | None = None) -> Any:
    """An argument object's Python state (a KV cache: its layers, their tensors and counters):
    scalars by value, tensors by metadata, objects by type and state, those deeper than `depth`
    by identity. `read` is told what the walk looked at: the containers, and each tensor with its
    `place` (where it sits: (list, index), (dict, key) or (object, attribute); None in a tuple),
    which a replay reads and writes."""
    tp = type(x)
    if tp in SCALARS:  # first: most fields are; isinstance of torch.Tensor costs a metaclass call
        return x
    if tp is torch.Tensor or isinstance(x, torch.Tensor):
        if read is not None:
            read.tensors.append(x)
            read.places.append(place)
        return ("T", x.shape, x.stride(), x.dtype)
    if depth == 0:
        return ("O", id(x))
    if tp is list or tp is tuple:
        if read is not None and tp is list:
            read.containers.append(x)
        return (tp.__name__, *[object_state(v, depth - 1, read, (x, k) if tp is list else None) for k, v in enumerate(x)])
    fields = x if tp is dict else getattr(x, "__dict__", None)
    if fields is None:
        return ("O", id(x))
    if read is not None:
        read.containers.append(fields)
    owner = fields if tp is dict else x
    state = tuple((k, object_state(v, depth - 1, read, (owner, k))) for k, v in fields.items())
    # by type, not identity: a trace reads the tensors where they sit (replay/trace.py), so a
    # new cache of the same state (each generate() makes one) replays the same trace
    return ("dict", *state) if tp is dict else (tp, *state)


def put(place: tuple, value: Any) -> None:
    """Set what sits at `place` (object_state's) to `value`."""
    owner, key = place
    if type(owner) is list or type(owner) is dict:
        owner[key] = value
    else:
        setattr(owner, key, value)


def put_path(obj: Any, path: tuple, value: Any) -> None:
    """Set the field `path` leads to from `obj` (a list's index, a dict's key or an attribute's
    name per step) to `value`."""
    for key in path[:-1]:
        obj = obj[key] if type(obj) is list or type(obj) is dict else getattr(obj, key)
    put((obj, path[-1]), value)


def _contents(containers: list) -> list:
    """Each container's length, a dict's keys, and the identity of every item, in one list."""
    out: list = []
    for c in containers:
        out.append(len(c))
        if type(c) is dict:
            out += c
            out += map(id, c.values())
        else:
            out += map(id, c)
    return out


def _metadata(tensors: list[torch.Tensor]) -> tuple:
    return [t.shape for t in tensors], [t.stride() for t in tensors], [t.dtype for t in tensors]


class Snapshot:
    """An argument object's state (`object_state`) and what its walk read: while every container
    holds the same objects and every tensor has the same metadata, the state is the same, and
    checking that is a fraction of the walk (a StaticCache's state has 781 items; a decode step
    built it on every call). `key` stands for the state in a guard key, without holding the
    object or its tensors (a key outlives the call: a grown cache's old tensors must not)."""
    __slots__ = ("obj", "containers", "tensors", "places", "state", "key", "_contents", "_items", "_meta")

    def __init__(self, obj: Any):
        self.obj = obj
        self.containers: list[list | dict] = []  # the lists and field dicts the walk read
        self.tensors: list[torch.Tensor] = []
        self.places: list[tuple | None] = []
        self.state = object_state(obj, read=self)
        self.key = _State(self.state)
        self._items = [list(c.values()) if type(c) is dict else list(c) for c in self.containers]  # keeps ids unique
        self._contents = _contents(self.containers)
        self._meta = _metadata(self.tensors)

    def holds(self, obj: Any) -> bool:
        """`obj` is this snapshot's object, unchanged."""
        return obj is self.obj and _contents(self.containers) == self._contents and _metadata(self.tensors) == self._meta

    def values(self) -> list[torch.Tensor]:
        return [real(t) for t in self.tensors]


def real(t: torch.Tensor) -> torch.Tensor:
    """The real tensor behind one an object holds (one made under capture, a cache's, is a lazy
    wrapper)."""
    return t._value if type(t) is LazyTensor and t._value is not None else t


class _State:
    """A state, hashed once."""
    __slots__ = ("state", "_hash", "erased")

    def __init__(self, state: Any):
        self.state, self._hash = state, hash(state)
        self.erased: tuple | None = None  # (structure, metas) of the state: `erased`'s, made once

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return self is other or (type(other) is _State and self._hash == other._hash and self.state == other.state)


_SPECS: dict[tuple, Any] = {}
_KNOWN: dict[int, tuple[bool, tuple]] = {}  # id(a spec in _SPECS) -> (is_plain(spec), a key that stands for it)


def flatten_call(args: tuple, kwargs: dict) -> tuple[list, Any]:
    """`pytree.tree_flatten((args, kwargs))`, without its walk when no argument is a container (a
    decode step's tensors, scalars and cache object): the structure is then the number of
    arguments and the keywords' names alone (the walk took 0.1 ms of a call after an idle gap)."""
    leaves = [*args, *kwargs.values()]
    for x in leaves:
        if isinstance(x, (tuple, list, dict)) or type(x) in pytree.SUPPORTED_NODES:
            return pytree.tree_flatten((args, kwargs))
    key = (len(args), tuple(kwargs))
    spec = _SPECS.get(key)
    if spec is None:
        spec = _SPECS[key] = pytree.tree_flatten((args, kwargs))[1]
        _KNOWN[id(spec)] = (is_plain(spec), key)  # a TreeSpec's hash is a Python walk: the key's is not
    return leaves, spec


def guard_key(modes: tuple, leaves: list, spec: Any, snapshots: dict | None = None) -> tuple | None:
    """What a trace is valid for, from the call's flattened arguments: tensor metadata, scalar
    values, other objects' identity and Python state (see `object_state`). `modes`: the training
    flags of the model and its submodules; `snapshots`: the last object seen at each argument
    position, whose state is reused while it holds."""
    plain, stands_for = _KNOWN.get(id(spec)) or (is_plain(spec), spec)
    if not plain:
        return None
    described = []
    for i, x in enumerate(leaves):
        if isinstance(x, torch.Tensor):
            if type(x) is not torch.Tensor:
                return None
            # where it sits in its storage is not described: a slice of a sequence at a new offset
            # replays (a trace that depends on offsets checks them: replay/trace.run)
            described.append((x.shape, x.stride(), x.dtype, x.device, x.requires_grad))
        elif type(x) in SCALARS:
            described.append((type(x), x))
        elif isinstance(x, torch.nn.Module):
            return None  # its parameters are not this module's weights: no guard covers them
        else:
            snap = snapshots.get(i) if snapshots is not None else None
            if snap is None or not snap.holds(x):
                snap = Snapshot(x)
                if snapshots is not None:
                    snapshots[i] = snap
            described.append(snap.key)
    return (stands_for, tuple(described), torch.is_grad_enabled(), modes, torch.get_default_dtype())


def erased(key: tuple) -> Flat:
    """A guard key as a `Flat` (torchnative.sizes): what calls at other sizes of the same
    structure share, and the sizes of every tensor it describes — the arguments' and those their
    objects hold (a DynamicCache's keys) — as integers, each an input's dim where it is a size."""
    structure: list = [key[0], key[2:]]
    ints: list[int] = []
    where: list[tuple] = []
    for i, d in enumerate(key[1]):
        if type(d) is _State:
            if d.erased is None:
                metas: list = []
                d.erased = (_state_structure(d.state, metas), metas)
            shape_structure, metas = d.erased
            structure.append(shape_structure)
            for j, m in enumerate(metas):
                meta_ints(m, structure, ints, where, (i, "input", j))
        elif _is_tensor(d):
            structure.append(d[3:])
            meta_ints((d[0], d[1], 0, d[2]), structure, ints, where, (i, "input", 0))
        else:
            structure.append(d)
    return Flat(structure, ints, where)


def _is_tensor(d: Any) -> bool:
    """Is this item of a guard key a tensor argument's description (guard_key)?"""
    return type(d) is tuple and len(d) == 5 and type(d[0]) is torch.Size


def _state_structure(state: Any, metas: list) -> Any:
    """An object's state with each tensor's metadata moved into `metas` (shape, stride, offset 0,
    dtype)."""
    if type(state) is tuple:
        if len(state) == 4 and state[0] == "T" and type(state[1]) is torch.Size:
            metas.append((tuple(state[1]), state[2], 0, state[3]))
            return "T"
        return tuple(_state_structure(s, metas) for s in state)
    return state


def same_apart_from_objects(key: tuple | None, after: tuple | None) -> bool:
    """Two guard keys of one call, at its start and end, agree but for argument objects' states
    (what the call put into its KV cache, which the tracer describes)."""
    if key is None or after is None:
        return key is after
    return key[0] == after[0] and key[2:] == after[2:] and all(
        a == b or type(a) is _State for a, b in zip(key[1], after[1]))

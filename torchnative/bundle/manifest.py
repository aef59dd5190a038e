"""The manifest, typed: what `bundle/save.py` writes and `bundle/load.py` reads, one set of
dataclasses for both (DESIGN.md §7). A method is a serialized replay `Trace` (replay/trace.py): its
programs in order, each with where its inputs come from (a `Source`), its partitions, the scalars
Python read from it (`Check`) and the states its last outputs are written into; then where the
method's outputs come from. Sizes are ints, or expressions in n (bundle/dynamic.py) in a method
that takes a range of sizes. JSON is the dataclasses' own form; a manifest that does not parse is
refused with what is wrong."""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

from torchnative.bundle.format import BundleError

Size = Any  # int, or an expression in n ("2*n+1")


@dataclass
class Source:
    """Where a value comes from: exactly one of a method argument, a weight, a state, a value an
    earlier program of the method made, a Python value, or a view (shape, stride, offset) of
    another source."""
    arg: str | None = None
    weight: str | None = None
    state: str | None = None
    value: str | None = None
    py: Any = None
    view: "Source | None" = None
    shape: list[Size] | None = None
    stride: list[Size] | None = None
    offset: Size | None = None

    def to_json(self) -> dict:
        if self.view is not None:
            return {"view": self.view.to_json(), "shape": self.shape, "stride": self.stride, "offset": self.offset}
        for kind in ("arg", "weight", "state", "value"):
            if getattr(self, kind) is not None:
                return {kind: getattr(self, kind)}
        return {"py": self.py}

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "Source":
        if not isinstance(obj, dict) or not obj:
            raise BundleError(f"{where}: a source must be an object; got {obj!r}")
        if "view" in obj:
            return cls(view=cls.from_json(obj["view"], where), shape=obj.get("shape"), stride=obj.get("stride"),
                       offset=obj.get("offset"))
        kind = next(iter(obj))
        if len(obj) != 1 or kind not in ("arg", "weight", "state", "value", "py"):
            raise BundleError(f"{where}: a source names one of arg, weight, state, value, py or view; got {sorted(obj)}")
        return cls(**{kind: obj[kind]})


@dataclass
class Layout:
    """A value's dtype and shape, and its strides (or, dense in some dim order, that order)."""
    dtype: str
    shape: list[Size]
    stride: list[Size] | None = None
    order: list[int] | None = None


@dataclass
class PartitionOutput(Layout):
    value: str = ""


@dataclass
class Fallback:
    """A compile-only delegate's partition as an eager program, run where the delegate does not."""
    artifact: str
    bytes: int
    sha256: str
    inputs: list[str]


@dataclass
class PartitionEntry:
    delegate: str
    artifact: str
    bytes: int
    sha256: str
    meta: dict
    constants: dict[str, str]          # the artifact's name for a weight -> the bundle's
    ops: int
    op_counts: dict[str, int]
    inputs: list[str]                  # the values it takes (program-local names)
    outputs: list[PartitionOutput]
    compile_s: float = 0.0
    fallback: Fallback | None = None
    # the build's check (build/verify.py): its gap from eager on the build inputs and the bound it
    # was held to ("inf" as text: JSON has no infinity); a declined partition is saved on eager
    gap: Any = None
    tolerance: str | None = None


@dataclass
class ProgramInput:
    value: str
    source: Source = field(metadata={"json": "from"})
    dtype: str | None = None           # for a state: what the graph was compiled for
    shape: list[Size] | None = None


@dataclass
class Check:
    """Python read `value` as a scalar after this program ran and chose its path by it."""
    value: str
    equals: Any
    op: str
    at: str


@dataclass
class ProgramEntry:
    key: str
    inputs: list[ProgramInput]
    partitions: list[PartitionEntry]
    outputs: list[str]
    checks: list[Check]
    writes: list[str]                  # states its last outputs are the new values of


@dataclass
class Input:
    name: str
    dtype: str
    shape: list[Size]
    range: list[int] | None = None     # an integer input's example values (`run --input x=random`)


@dataclass
class Output:
    name: str
    source: Source | None = field(default=None, metadata={"json": "from"})
    slice: list | None = None          # a bucketed method's: dims that follow n, (dim, expression)


@dataclass
class Bucket:
    n: int
    padded: bool
    method: str


@dataclass
class MethodEntry:
    inputs: list[Input]
    outputs: list[Output]
    programs: list[ProgramEntry] = field(default_factory=list)
    size: dict | None = None           # the size n dims share: name, range, dims, example
    buckets: list[Bucket] | None = None  # run as buckets of sizes (bundle/buckets.py)


@dataclass
class State:
    name: str
    dtype: str
    shape: list[int]
    init: str


@dataclass
class Weights:
    file: str
    bytes: int
    sha256: str
    tensors: dict[str, dict]


@dataclass
class Pinned:
    name: str
    reason: str


@dataclass
class Manifest:
    schema: int
    model: str
    created: str
    toolchain: dict[str, str]
    weights: Weights
    pinned: list[Pinned]
    state: list[State]
    methods: dict[str, MethodEntry]
    generate: dict | None = None       # how `Bundle.generate` drives the methods

    def to_json(self) -> dict:
        return _to_json(self)

    @classmethod
    def from_json(cls, obj: Any, where: str) -> "Manifest":
        return _from_json(cls, obj, where)


def _name(f: dataclasses.Field) -> str:
    return f.metadata.get("json", f.name)


def _to_json(x: Any) -> Any:
    if isinstance(x, Source):
        return x.to_json()
    if dataclasses.is_dataclass(x):
        out = {}
        for f in dataclasses.fields(x):
            v = getattr(x, f.name)
            if v is not None or f.default is dataclasses.MISSING:
                out[_name(f)] = _to_json(v)
        return out
    if isinstance(x, dict):
        return {k: _to_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_to_json(v) for v in x]
    return x


def _from_json(tp: Any, obj: Any, where: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any or tp is Size:
        return obj
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        if obj is None and type(None) in args:
            return None
        return _from_json(next(a for a in args if a is not type(None)), obj, where)
    if tp is Source:
        return Source.from_json(obj, where)
    if dataclasses.is_dataclass(tp):
        if not isinstance(obj, dict):
            raise BundleError(f"{where}: expected an object for {tp.__name__}, got {type(obj).__name__}")
        hints = typing.get_type_hints(tp)
        kwargs = {}
        for f in dataclasses.fields(tp):
            key = _name(f)
            if key in obj:
                kwargs[f.name] = _from_json(hints[f.name], obj[key], f"{where}.{key}")
            elif f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING:
                raise BundleError(f"{where} lacks {key!r} ({tp.__name__}): the manifest is malformed; write the bundle again")
        return tp(**kwargs)
    if origin is list:
        if not isinstance(obj, list):
            raise BundleError(f"{where}: expected a list, got {type(obj).__name__}")
        return [_from_json(args[0] if args else Any, v, f"{where}[{i}]") for i, v in enumerate(obj)]
    if origin is dict:
        if not isinstance(obj, dict):
            raise BundleError(f"{where}: expected an object, got {type(obj).__name__}")
        return {k: _from_json(args[1] if args else Any, v, f"{where}.{k}") for k, v in obj.items()}
    if tp in (int, float, str, bool) and not isinstance(obj, tp if tp is not float else (int, float)):
        raise BundleError(f"{where}: expected {tp.__name__}, got {obj!r}")
    return obj

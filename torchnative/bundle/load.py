"""A bundle → a callable that runs it without the model's Python code: each method is loaded back
as the replay trace it was saved from (bundle/manifest.py), its programs its partitions' loaded
runners, and run by `replay.trace.run`, the interpreter a replayed call runs on. Everything that
can be checked is checked while loading (schema, every file's size and hash, delegates available
here, every source and layout), and every call's inputs against the manifest, so a bad bundle or
input fails with a message that names it, before any delegate sees it."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torch.utils import _pytree as pytree

from torchnative.build.program import CapturedOpError, Program, Step
from torchnative.bundle import manifest as m
from torchnative.bundle.buckets import cut, pad, serves
from torchnative.bundle.dynamic import evaluate
from torchnative.bundle.format import BundleError, Reader
from torchnative.delegates import REGISTRY
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Artifact
from torchnative.lru import Lru
from torchnative.replay.trace import GraphCall, Miss, Trace, run
from torchnative.sizes import dense_strides
from torchnative.quiet import quiet


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(f"the manifest names dtype {name!r}, which this torch does not have")
    return dtype


def _describe(dtype: torch.dtype | str, shape: Any) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"


def _load_partition(reader: Reader, part: m.PartitionEntry, weights: dict) -> tuple[Callable, list[str], str]:
    """The partition's runner, the values it takes, and why it runs on eager here if it does
    (a compile-only delegate's partition, run by its eager fallback)."""
    name = part.delegate
    delegate = REGISTRY.get(name)
    if delegate is None:
        raise BundleError(f"{reader.path} has a partition for delegate {name!r}, which this torchnative does not "
                          f"know (known: {', '.join(sorted(REGISTRY))}); upgrade torchnative")
    status = delegate.available()
    if status.status != "executes" and part.fallback is not None:
        reader.checked(part.artifact, part)  # shipped for its device: still whole
        fallback = part.fallback
        return _exported(reader.checked(fallback.artifact, fallback)), fallback.inputs, f"{name}: {status.reason}"
    if status.status != "executes":
        raise BundleError(f"{reader.path} needs delegate {name!r} ({part.ops} ops in {part.artifact}), which "
                          f"cannot execute here: {status.reason}"
                          + (f"; install: {status.install_hint}" if status.install_hint else "")
                          + "; or write the bundle again with --targets that this machine runs")
    payload = reader.checked(part.artifact, part)
    if name == eager.name:
        return _exported(payload), part.inputs, ""
    try:
        constants = {local: weights[name] for local, name in part.constants.items()}
        with quiet():
            return delegate.load(Artifact(name, payload, part.meta, constants)), part.inputs, ""
    except Exception as e:
        raise BundleError(f"delegate {name!r} could not load {part.artifact} of {reader.path}: "
                          f"{type(e).__name__}: {e}") from e


def _exported(payload: bytes) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    module = torch.export.load(io.BytesIO(payload)).module()
    return lambda inputs: list(module(*inputs))


class _Signature:
    """What a method takes and returns, and the binding of a call's inputs to it."""

    def __init__(self, name: str, spec: m.MethodEntry):
        self.name, self.spec = name, spec
        self.inputs: dict[str, tuple[torch.dtype, tuple[int | str, ...]]] = {  # a size as an expression in n: bundle/dynamic.py
            i.name: (_dtype(i.dtype), tuple(i.shape)) for i in spec.inputs}
        self.size: dict | None = spec.size  # the size n dynamic dims share, and its range
        self.outputs = [o.name for o in spec.outputs]

    def _bind(self, args: tuple, kwargs: dict) -> tuple[dict[str, torch.Tensor], int]:
        names = list(self.inputs)
        if len(args) > len(names):
            raise BundleError(f"{len(args)} positional inputs given, {self.name} takes {len(names)}: {names}")
        given = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in given:
                raise BundleError(f"input {k!r} given twice")
            given[k] = v
        unknown = [k for k in given if k not in self.inputs]
        missing = [k for k in names if k not in given]
        if unknown or missing:
            raise BundleError(f"{self.name} takes inputs {names}; " + "; ".join(
                x for x in (f"unknown: {unknown}" if unknown else "", f"missing: {missing}" if missing else "") if x))
        n = self._size(given)
        for k, (dtype, shape) in self.inputs.items():
            v = given[k]
            if not isinstance(v, torch.Tensor):
                raise BundleError(f"input {k!r} must be a tensor {_describe(dtype, shape)}, got {type(v).__name__}")
            if v.dtype != dtype or tuple(v.shape) != tuple(evaluate(x, n) for x in shape):
                sized = " with n " + "..".join(map(str, self.size["range"])) if self.size else " (as captured)"
                raise BundleError(f"input {k!r} must be {_describe(dtype, shape)}{sized}, got "
                                  f"{_describe(v.dtype, v.shape)}; to run other shapes, capture again with "
                                  f"--example-input {k}={_describe(v.dtype, v.shape).replace(' ', '')}"
                                  + (" or --dynamic" if not self.size else ""))
        return given, n

    def _size(self, given: dict) -> int:
        """The size n the inputs' dynamic dims share (0 for a bundle of one size), in its range."""
        if not self.size:
            return 0
        sizes = {f"{name}:{d}": given[name].shape[d] for name, d in self.size["dims"]
                 if isinstance(given.get(name), torch.Tensor) and d < given[name].dim()}
        low, high = self.size["range"]
        if len(set(sizes.values())) != 1 or len(sizes) != len(self.size["dims"]):
            raise BundleError(f"{', '.join(f'{name}:{d}' for name, d in self.size['dims'])} share one size n in "
                              f"{self.name}; got {sizes}")
        n = next(iter(sizes.values()))
        if not low <= n <= high:
            raise BundleError(f"n = {n} ({', '.join(sizes)}) is out of this bundle's range {low}..{high}: capture again "
                              f"with --dynamic ...={min(low, n)}..{max(high, n)} if the model takes it")
        return n


class Method(_Signature):
    """One method of a bundle (`forward`, or a causal LM's `prefill` and `decode`):
    `method(input_ids=t, ...)` (or positionally, in the order of `method.inputs`) returns a dict
    of output name -> tensor. It is a replay trace loaded back (`method.trace(n)`), its programs
    its partitions' loaded runners, run by the interpreter replayed calls run on
    (`replay.trace.run`); its graphs read and write the bundle's states in place."""

    def __init__(self, bundle: "Bundle", name: str, spec: m.MethodEntry, reader: Reader):
        super().__init__(name, spec)
        self.bundle = bundle
        runners = {(k, j): _load_partition(reader, part, bundle.weights)
                   for k, g in enumerate(spec.programs) for j, part in enumerate(g.partitions)}
        for k, g in enumerate(spec.programs):
            unknown = [s for s in g.writes if s not in bundle.states]
            if unknown:
                raise BundleError(f"method {name!r} of {bundle.path} writes states {unknown} that the manifest does "
                                  f"not declare: the bundle was tampered with; write it again")
        # partitions for a delegate that does not execute here, run by their eager fallback: (graph, #, why)
        self.fallbacks = [(k, j, why) for (k, j), (_, _, why) in runners.items() if why]
        self._runners = runners
        self._steps = [[Step(part.delegate if not runners[k, j][2] else eager.name, None, [], [], [], runners[k, j][0],
                             label=f"partition {j} of graph {k} of {name} ({part.delegate}, {part.ops} ops, {part.artifact})",
                             ops=part.ops)
                        for j, part in enumerate(g.partitions)] for k, g in enumerate(spec.programs)]
        self._made = {v: (k, j) for k, g in enumerate(spec.programs) for j, v in enumerate(g.outputs)}
        self._out_spec = pytree.tree_flatten(dict.fromkeys(self.outputs))[1]
        self._traces = Lru(64, "bundle method sizes")  # n -> the trace at n
        self.trace(n=spec.size["example"] if spec.size else 0)  # every source and layout checked at load

    def trace(self, n: int = 0) -> Trace:
        """This method as a replay trace at size n (0 for a method of one size): its sizes that
        follow n evaluated."""
        found = self._traces.get(n)
        if found is None:
            steps = tuple(self._call(k, g, n) for k, g in enumerate(self.spec.programs))
            outputs = tuple(self._source(o.source, n) for o in self.spec.outputs)
            found = self._traces[n] = Trace(steps, outputs, self._out_spec, None)
        return found

    def _call(self, k: int, g: m.ProgramEntry, n: int) -> GraphCall:
        at = {i.value: p for p, i in enumerate(g.inputs)}  # a value's position in what a run builds
        made = len(g.inputs)
        args, layouts = [], []
        for j, part in enumerate(g.partitions):
            args.append([_position(at, v, self.name, k) for v in self._runners[k, j][1]])
            layouts.append([_layout(o, n) for o in part.outputs])
            for o in part.outputs:  # a state written in place is made again under its own name
                at[o.value], made = made, made + 1
        program = Program.assembled(self._steps[k], len(g.inputs), args, [_position(at, v, self.name, k) for v in g.outputs],
                                    layouts)
        reads = tuple((g.outputs.index(c.value), c.equals) for c in g.checks)
        return GraphCall(program, tuple(self._source(i.source, n) for i in g.inputs), reads,
                         tuple(("const", self.bundle.states[w]) for w in g.writes))

    def _source(self, src: m.Source, n: int) -> tuple:
        if src.view is not None:
            return ("view", self._source(src.view, n), tuple(evaluate(x, n) for x in src.shape),
                    tuple(evaluate(x, n) for x in src.stride), evaluate(src.offset, n))
        if src.arg is not None:
            return ("arg", list(self.inputs).index(src.arg))
        if src.value is not None:
            if src.value not in self._made:
                raise BundleError(f"{self.name} of {self.bundle.path} reads {src.value!r}, which no graph of it makes: "
                                  f"the manifest was tampered with; write the bundle again")
            return ("out", *self._made[src.value])
        named = (self.bundle.weights, src.weight) if src.weight is not None else (self.bundle.states, src.state) \
            if src.state is not None else (None, None)
        if named[0] is None:
            return ("py", src.py)
        if named[1] not in named[0]:
            raise BundleError(f"{self.name} of {self.bundle.path} reads {named[1]!r}, which the bundle does not hold: "
                              f"the manifest was tampered with; write the bundle again")
        return ("const", named[0][named[1]])

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, Any]:
        given, n = self._bind(args, kwargs)
        with torch.no_grad():
            try:
                out = run(self.trace(n), [given[name] for name in self.inputs], {})
            except CapturedOpError as e:
                raise BundleError(str(e)) from e
        if type(out) is Miss:
            check = self.spec.programs[out.step].checks[out.read]
            raise BundleError(
                f"these inputs take another path through the model than the captured ones: the model reads the "
                f"value of {check.op} at {check.at} to decide what to do next; it was {check.equals!r} when "
                f"captured and is {out.got!r} now. Capture again with inputs like these")
        return out


def _position(at: dict[str, int], value: str, method: str, k: int) -> int:
    if value not in at:
        raise BundleError(f"graph {k} of {method} reads {value!r} before any partition makes it: the manifest was "
                          f"tampered with; write the bundle again")
    return at[value]


def _layout(o: m.PartitionOutput, n: int) -> tuple:
    """(shape, strides, dtype) of a partition output at n: what Program checks and lays it out as."""
    shape = tuple(evaluate(x, n) for x in o.shape)
    stride = dense_strides(shape, tuple(o.order)) if o.order is not None else tuple(evaluate(x, n) for x in o.stride)
    return shape, stride, _dtype(o.dtype)


class Bucketed(_Signature):
    """A method run as buckets of sizes (bundle/buckets.py): a call pads its inputs to the
    smallest bucket that serves their n, runs that bucket's method, and cuts the outputs back."""

    def __init__(self, name: str, spec: m.MethodEntry, methods: dict[str, Method]):
        super().__init__(name, spec)
        missing = [b.method for b in spec.buckets if b.method not in methods]
        if missing:
            raise BundleError(f"method {name!r} runs as buckets {missing} that the manifest does not hold: the "
                              f"bundle was tampered with; write it again")
        self.buckets = [(b.n, b.padded, methods.pop(b.method)) for b in spec.buckets]
        self.fallbacks = [f for _, _, method in self.buckets for f in method.fallbacks]

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, Any]:
        given, n = self._bind(args, kwargs)
        size, padded, method = next(b for b in self.buckets if serves(b[0], b[1], n))  # _bind kept n in the range
        if not padded:
            return method(**given)
        outputs = method(**pad(given, self.size["dims"], size))
        return {o.name: cut(outputs[o.name], o.slice, n) for o in self.spec.outputs}


class Bundle:
    """A loaded bundle: its methods (`bundle.methods`, each also an attribute: `bundle.decode`),
    its weights and its states. A bundle of one call is called directly: `bundle(input_ids=t)`.
    A causal LM's bundle generates: `bundle.generate(ids, max_new_tokens=32)`."""

    def __init__(self, path: str | Path):
        reader = Reader(path)
        self.path = reader.path
        self.manifest = reader.manifest()  # as read (JSON); `spec` is it typed
        self._state_spec()
        self.spec = m.Manifest.from_json(self.manifest, f"{self.path}/manifest.json")
        self.pinned = {p.name: p.reason for p in self.spec.pinned}
        self.weights = self._weights(reader)
        self.states: dict[str, torch.Tensor] = {s.name: torch.zeros(s.shape, dtype=_dtype(s.dtype)) for s in self.spec.state}
        specs = self.spec.methods
        self.methods: dict[str, Method | Bucketed] = {
            name: Method(self, name, spec, reader) for name, spec in specs.items() if spec.buckets is None}
        self.methods.update({name: Bucketed(name, spec, self.methods) for name, spec in specs.items() if spec.buckets is not None})
        if not self.methods:
            raise BundleError(f"{self.path}/manifest.json lists no methods; write the bundle again")
        self.fallbacks = [f for m in self.methods.values() for f in m.fallbacks]

    def _state_spec(self) -> None:
        """The state spec is whole and agrees with the graphs (checked on the manifest as read:
        what is wrong with it is said in its terms)."""
        spec = self.manifest.get("state")
        if not isinstance(spec, list) or not all(isinstance(s, dict) and {"name", "dtype", "shape", "init"} <= set(s)
                                                 and s["init"] == "zeros" for s in spec):
            raise BundleError(f"the state spec in {self.path}/manifest.json is missing or malformed (each state needs "
                              f"name, dtype, shape and init \"zeros\"); write the bundle again")
        declared = {s["name"]: s for s in spec}
        for m in self.manifest["methods"].values():  # the graphs were compiled for the declared shapes
            for i in (i for g in m.get("programs", ()) for i in g["inputs"] if "state" in i["from"]):
                s = declared.get(i["from"]["state"])
                if s is None or (s["shape"], s["dtype"]) != (i["shape"], i["dtype"]):
                    raise BundleError(f"a graph of {self.path} reads state {i['from']['state']!r} as "
                                      f"{_describe(i['dtype'], i['shape'])}, which the manifest's state spec "
                                      + ("does not declare" if s is None else f"declares {_describe(s['dtype'], s['shape'])}")
                                      + ": the manifest was tampered with; write the bundle again")

    def _weights(self, reader: Reader) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        spec = self.spec.weights
        weights = load(reader.checked(spec.file, spec))
        missing = set(spec.tensors) - set(weights)
        if missing:
            raise BundleError(f"{spec.file} of {self.path} lacks {sorted(missing)[:5]}; write the bundle again")
        return weights

    def __getattr__(self, name: str) -> Method:
        methods = self.__dict__.get("methods", {})
        if name in methods:
            return methods[name]
        raise AttributeError(f"{type(self).__name__} has no attribute or method {name!r} (methods: {sorted(methods)})")

    @property
    def inputs(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        """The inputs of the bundle's one method (`forward`), or of the first."""
        return next(iter(self.methods.values())).inputs

    @property
    def outputs(self) -> list[str]:
        return next(iter(self.methods.values())).outputs

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, Any]:
        if len(self.methods) != 1:
            raise BundleError(f"{self.path} has methods {sorted(self.methods)}: call one of them "
                              f"(bundle.{next(iter(self.methods))}(...))" + (", or bundle.generate(ids)" if "generate" in self.manifest else ""))
        return next(iter(self.methods.values()))(*args, **kwargs)

    def reset(self) -> None:
        """Every state back to its initial value (zeros): a new sequence."""
        for t in self.states.values():
            t.zero_()

    def set_state(self, name: str, value: torch.Tensor) -> None:
        """Replace a state's value (a cache saved earlier); the next call reads it."""
        if name not in self.states:
            raise BundleError(f"{name!r} is not a state of this bundle (states: {sorted(self.states)[:4] or 'none'}…)")
        old = self.states[name]
        if not isinstance(value, torch.Tensor) or value.dtype != old.dtype or value.shape != old.shape:
            got = _describe(value.dtype, value.shape) if isinstance(value, torch.Tensor) else type(value).__name__
            raise BundleError(f"state {name!r} is {_describe(old.dtype, old.shape)}, got {got}")
        old.copy_(value)

    def generate(self, input_ids: torch.Tensor, max_new_tokens: int = 32, eos: int | Sequence[int] | None = None,
                 on_token: Callable[[int], None] = lambda token: None) -> torch.Tensor:
        """Greedy decoding (as `model.generate(ids, do_sample=False)`): the prompt `input_ids`
        [1, n] followed by up to `max_new_tokens` tokens, stopping after an `eos` token (default:
        the model's). Starts from empty states; `on_token(t)` follows each new token."""
        from torchnative.bundle.generate import greedy

        return greedy(self, input_ids, max_new_tokens, eos, on_token)

    def update(self, name: str, value: torch.Tensor) -> None:
        """Replace a pinned weight (one updated at test time); the next call uses it."""
        if name not in self.pinned:
            raise BundleError(f"{name!r} is not a pinned tensor of this bundle (pinned: {sorted(self.pinned) or 'none'}); "
                              f"only pinned tensors are inputs of its partitions, the rest are compiled in")
        old = self.weights[name]
        if value.dtype != old.dtype or value.shape != old.shape:
            raise BundleError(f"{name!r} is {_describe(old.dtype, old.shape)}, got {_describe(value.dtype, value.shape)}")
        old.copy_(value.detach())  # in place: the methods' traces hold this tensor


def load(path: str | Path) -> Bundle:
    """Load and check a bundle written by `torchnative capture-and-compile`."""
    return Bundle(path)

"""A bundle → a callable that runs it without the model's Python code. Everything that can be
checked is checked while loading (schema, every file's size and hash, delegates available here),
and every call's inputs against the manifest, so a bad bundle or input fails with a message that
names it, before any delegate sees it."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from torchnative.bundle.buckets import cut, pad, serves
from torchnative.bundle.dynamic import evaluate
from torchnative.bundle.format import BundleError, Reader
from torchnative.delegates import REGISTRY
from torchnative.interface import Artifact
from torchnative.delegates.eager import delegate as eager
from torchnative.sizes import dense_strides


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(f"the manifest names dtype {name!r}, which this torch does not have")
    return dtype


def _describe(dtype: torch.dtype | str, shape: Any) -> str:
    return f"{str(dtype).removeprefix('torch.')}[{', '.join(map(str, shape))}]"


def _load_partition(reader: Reader, part: dict, weights: dict) -> tuple[Callable, list[str], str]:
    """The partition's runner, the values it takes, and why it runs on eager here if it does
    (a compile-only delegate's partition, run by its eager fallback)."""
    name = part["delegate"]
    delegate = REGISTRY.get(name)
    if delegate is None:
        raise BundleError(f"{reader.path} has a partition for delegate {name!r}, which this torchnative does not "
                          f"know (known: {', '.join(sorted(REGISTRY))}); upgrade torchnative")
    status = delegate.available()
    if status.status != "executes" and "fallback" in part:
        reader.checked(part["artifact"], part)  # shipped for its device: still whole
        fallback = part["fallback"]
        return _exported(reader.checked(fallback["artifact"], fallback)), fallback["inputs"], f"{name}: {status.reason}"
    if status.status != "executes":
        raise BundleError(f"{reader.path} needs delegate {name!r} ({part['ops']} ops in {part['artifact']}), which "
                          f"cannot execute here: {status.reason}"
                          + (f"; install: {status.install_hint}" if status.install_hint else "")
                          + "; or write the bundle again with --targets that this machine runs")
    payload = reader.checked(part["artifact"], part)
    if name == eager.name:
        return _exported(payload), part["inputs"], ""
    try:
        constants = {local: weights[name] for local, name in part["constants"].items()}
        return delegate.load(Artifact(name, payload, part["meta"], constants)), part["inputs"], ""
    except Exception as e:
        raise BundleError(f"delegate {name!r} could not load {part['artifact']} of {reader.path}: "
                          f"{type(e).__name__}: {e}") from e


def _exported(payload: bytes) -> Callable[[list[torch.Tensor]], list[torch.Tensor]]:
    module = torch.export.load(io.BytesIO(payload)).module()
    return lambda inputs: list(module(*inputs))


class _Signature:
    """What a method takes and returns, and the binding of a call's inputs to it."""

    def __init__(self, name: str, spec: dict):
        self.name, self.spec = name, spec
        self.inputs: dict[str, tuple[torch.dtype, tuple[int | str, ...]]] = {  # a size as an expression in n: bundle/dynamic.py
            i["name"]: (_dtype(i["dtype"]), tuple(i["shape"])) for i in spec["inputs"]}
        self.size: dict | None = spec.get("size")  # the size n dynamic dims share, and its range
        self.outputs = [o["name"] for o in spec["outputs"]]

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
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
    of output name -> tensor. Its graphs read and write the bundle's states in place."""

    def __init__(self, bundle: "Bundle", name: str, spec: dict, reader: Reader):
        super().__init__(name, spec)
        self.bundle = bundle
        self._runners = {(k, j): _load_partition(reader, part, bundle.weights)
                         for k, g in enumerate(spec["programs"]) for j, part in enumerate(g["partitions"])}
        for g in spec["programs"]:
            unknown = [s for s in g["writes"] if s not in bundle.states]
            if unknown:
                raise BundleError(f"method {name!r} of {bundle.path} writes states {unknown} that the manifest does "
                                  f"not declare: the bundle was tampered with; write it again")
        # partitions for a delegate that does not execute here, run by their eager fallback: (graph, #, why)
        self.fallbacks = [(k, j, why) for (k, j), (_, _, why) in self._runners.items() if why]

    def _source(self, src: dict, env: dict, given: dict, n: int) -> Any:
        if "arg" in src:
            return given[src["arg"]]
        if "weight" in src:
            return self.bundle.weights[src["weight"]]
        if "state" in src:
            return self.bundle.states[src["state"]]
        if "value" in src:
            return env[src["value"]]
        if "view" in src:
            return self._source(src["view"], env, given, n).as_strided(
                [evaluate(x, n) for x in src["shape"]], [evaluate(x, n) for x in src["stride"]], evaluate(src["offset"], n))
        return src["py"]

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, Any]:
        given, n = self._bind(args, kwargs)
        env: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for k, program in enumerate(self.spec["programs"]):
                for i in program["inputs"]:
                    env[i["value"]] = self._source(i["from"], env, given, n)
                for j, part in enumerate(program["partitions"]):
                    outs = self._run(k, j, part, [env[v] for v in self._runners[k, j][1]], n)
                    env.update(zip((o["value"] for o in part["outputs"]), outs))
                self._write(program, env)
                for check in program["checks"]:
                    got = env[check["value"]].item()
                    if type(got) is not type(check["equals"]) or got != check["equals"]:
                        raise BundleError(
                            f"these inputs take another path through the model than the captured ones: the model "
                            f"reads the value of {check['op']} at {check['at']} to decide what to do next; it was "
                            f"{check['equals']!r} when captured and is {got!r} now. Capture again with inputs like these")
            return {o["name"]: self._source(o["from"], env, given, n) for o in self.spec["outputs"]}

    def _write(self, program: dict, env: dict) -> None:
        """The program's last outputs are its states' new values: into the states (a partition
        that wrote a state in place returned the state itself)."""
        if not program["writes"]:
            return
        values = program["outputs"][len(program["outputs"]) - len(program["writes"]):]
        for name, value in zip(program["writes"], values):
            state, new = self.bundle.states[name], env[value]
            if new.data_ptr() != state.data_ptr() or new.stride() != state.stride():
                state.copy_(new)

    def _run(self, k: int, j: int, part: dict, inputs: list[torch.Tensor], n: int) -> list[torch.Tensor]:
        try:
            outs = self._runners[k, j][0](inputs)
        except Exception as e:
            raise BundleError(f"partition {j} of graph {k} of {self.name} ({part['delegate']}, {part['ops']} ops, "
                              f"{part['artifact']}) failed: {type(e).__name__}: {e}") from e
        fixed = []
        for v, o in zip(outs, part["outputs"]):
            if list(v.shape) != [evaluate(x, n) for x in o["shape"]] or str(v.dtype).removeprefix("torch.") != o["dtype"]:
                raise BundleError(f"partition {j} of graph {k} of {self.name} ({part['delegate']}) returned "
                                  f"{_describe(v.dtype, v.shape)} for {o['value']}, the manifest says "
                                  f"{_describe(o['dtype'], o['shape'])}" + (f" with n = {n}" if self.size else ""))
            stride = dense_strides(tuple(v.shape), tuple(o["order"])) if "order" in o else [evaluate(x, n) for x in o["stride"]]
            if list(v.stride()) != list(stride) and v.numel() > 1 and 0 not in stride:
                v = torch.empty_strided(v.shape, stride, dtype=v.dtype).copy_(v)  # eager's layout, as in Program
            fixed.append(v)
        return fixed


class Bucketed(_Signature):
    """A method run as buckets of sizes (bundle/buckets.py): a call pads its inputs to the
    smallest bucket that serves their n, runs that bucket's method, and cuts the outputs back."""

    def __init__(self, name: str, spec: dict, methods: dict[str, Method]):
        super().__init__(name, spec)
        missing = [b["method"] for b in spec["buckets"] if b["method"] not in methods]
        if missing:
            raise BundleError(f"method {name!r} runs as buckets {missing} that the manifest does not hold: the "
                              f"bundle was tampered with; write it again")
        self.buckets = [(b["n"], b["padded"], methods.pop(b["method"])) for b in spec["buckets"]]
        self.fallbacks = [f for _, _, m in self.buckets for f in m.fallbacks]

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, Any]:
        given, n = self._bind(args, kwargs)
        size, padded, method = next(b for b in self.buckets if serves(b[0], b[1], n))  # _bind kept n in the range
        if not padded:
            return method(**given)
        outputs = method(**pad(given, self.size["dims"], size))
        return {o["name"]: cut(outputs[o["name"]], o["slice"], n) for o in self.spec["outputs"]}


class Bundle:
    """A loaded bundle: its methods (`bundle.methods`, each also an attribute: `bundle.decode`),
    its weights and its states. A bundle of one call is called directly: `bundle(input_ids=t)`.
    A causal LM's bundle generates: `bundle.generate(ids, max_new_tokens=32)`."""

    def __init__(self, path: str | Path):
        reader = Reader(path)
        self.path = reader.path
        self.manifest = reader.manifest()
        self.pinned = {p["name"]: p["reason"] for p in self.manifest["pinned"]}
        self.weights = self._weights(reader)
        self.states: dict[str, torch.Tensor] = {
            s["name"]: torch.zeros(s["shape"], dtype=_dtype(s["dtype"])) for s in self._state_spec()}
        specs = self.manifest["methods"]
        self.methods: dict[str, Method | Bucketed] = {
            name: Method(self, name, spec, reader) for name, spec in specs.items() if "buckets" not in spec}
        self.methods.update({name: Bucketed(name, spec, self.methods) for name, spec in specs.items() if "buckets" in spec})
        if not self.methods:
            raise BundleError(f"{self.path}/manifest.json lists no methods; write the bundle again")
        self.fallbacks = [f for m in self.methods.values() for f in m.fallbacks]

    def _state_spec(self) -> list[dict]:
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
        return spec

    def _weights(self, reader: Reader) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        spec = self.manifest["weights"]
        weights = load(reader.checked(spec["file"], spec))
        missing = set(spec["tensors"]) - set(weights)
        if missing:
            raise BundleError(f"{spec['file']} of {self.path} lacks {sorted(missing)[:5]}; write the bundle again")
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
        self.weights[name] = value.detach().contiguous()


def load(path: str | Path) -> Bundle:
    """Load and check a bundle written by `torchnative capture-and-compile`."""
    return Bundle(path)

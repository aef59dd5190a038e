"""A bundle → a callable that runs it without the model's Python code. Everything that can be
checked is checked while loading (schema, every file's size and hash, delegates available here),
and every call's inputs against the manifest, so a bad bundle or input fails with a message that
names it, before any delegate sees it."""
from __future__ import annotations

import io
from pathlib import Path
from typing import Any, Callable

import torch

from torchnative.bundle.format import BundleError, Reader
from torchnative.delegates import REGISTRY
from torchnative.interface import Artifact
from torchnative.delegates.eager import delegate as eager


def _dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise BundleError(f"the manifest names dtype {name!r}, which this torch does not have")
    return dtype


def _describe(dtype: torch.dtype | str, shape: Any) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


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


class Bundle:
    """A loaded bundle: `bundle(input_ids=t, ...)` (or positionally, in the order of
    `bundle.inputs`) returns a dict of output name -> tensor."""

    def __init__(self, path: str | Path):
        reader = Reader(path)
        self.path = reader.path
        self.manifest = reader.manifest()
        self.inputs: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {
            i["name"]: (_dtype(i["dtype"]), tuple(i["shape"])) for i in self.manifest["inputs"]}
        self.outputs = [o["name"] for o in self.manifest["outputs"]]
        self.pinned = {p["name"]: p["reason"] for p in self.manifest["pinned"]}
        self.weights = self._weights(reader)
        self._runners = {(k, j): _load_partition(reader, part, self.weights)
                         for k, g in enumerate(self.manifest["programs"]) for j, part in enumerate(g["partitions"])}
        # partitions for a delegate that does not execute here, run by their eager fallback: (graph, #, why)
        self.fallbacks = [(k, j, why) for (k, j), (_, _, why) in self._runners.items() if why]

    def _weights(self, reader: Reader) -> dict[str, torch.Tensor]:
        from safetensors.torch import load

        spec = self.manifest["weights"]
        weights = load(reader.checked(spec["file"], spec))
        missing = set(spec["tensors"]) - set(weights)
        if missing:
            raise BundleError(f"{spec['file']} of {self.path} lacks {sorted(missing)[:5]}; write the bundle again")
        return weights

    def update(self, name: str, value: torch.Tensor) -> None:
        """Replace a pinned weight (one updated at test time); the next call uses it."""
        if name not in self.pinned:
            raise BundleError(f"{name!r} is not a pinned tensor of this bundle (pinned: {sorted(self.pinned) or 'none'}); "
                              f"only pinned tensors are inputs of its partitions, the rest are compiled in")
        old = self.weights[name]
        if value.dtype != old.dtype or value.shape != old.shape:
            raise BundleError(f"{name!r} is {_describe(old.dtype, old.shape)}, got {_describe(value.dtype, value.shape)}")
        self.weights[name] = value.detach().contiguous()

    def _bind(self, args: tuple, kwargs: dict) -> dict[str, torch.Tensor]:
        names = list(self.inputs)
        if len(args) > len(names):
            raise BundleError(f"{len(args)} positional inputs given, the bundle takes {len(names)}: {names}")
        given = dict(zip(names, args))
        for k, v in kwargs.items():
            if k in given:
                raise BundleError(f"input {k!r} given twice")
            given[k] = v
        unknown = [k for k in given if k not in self.inputs]
        missing = [k for k in names if k not in given]
        if unknown or missing:
            raise BundleError(f"the bundle takes inputs {names}; " + "; ".join(
                x for x in (f"unknown: {unknown}" if unknown else "", f"missing: {missing}" if missing else "") if x))
        for k, (dtype, shape) in self.inputs.items():
            v = given[k]
            if not isinstance(v, torch.Tensor):
                raise BundleError(f"input {k!r} must be a tensor {_describe(dtype, shape)}, got {type(v).__name__}")
            if v.dtype != dtype or tuple(v.shape) != shape:
                raise BundleError(f"input {k!r} must be {_describe(dtype, shape)} (as captured), got "
                                  f"{_describe(v.dtype, v.shape)}; to run other shapes, capture again with "
                                  f"--example-input {k}={_describe(v.dtype, v.shape).replace(' ', '')}")
        return given

    def _source(self, src: dict, env: dict, given: dict) -> Any:
        if "arg" in src:
            return given[src["arg"]]
        if "weight" in src:
            return self.weights[src["weight"]]
        if "value" in src:
            return env[src["value"]]
        if "view" in src:
            return self._source(src["view"], env, given).as_strided(src["shape"], src["stride"], src["offset"])
        return src["py"]

    def __call__(self, *args: torch.Tensor, **kwargs: torch.Tensor) -> dict[str, Any]:
        given = self._bind(args, kwargs)
        env: dict[str, torch.Tensor] = {}
        with torch.no_grad():
            for k, program in enumerate(self.manifest["programs"]):
                for i in program["inputs"]:
                    env[i["value"]] = self._source(i["from"], env, given)
                for j, part in enumerate(program["partitions"]):
                    outs = self._run(k, j, part, [env[n] for n in self._runners[k, j][1]])
                    env.update(zip((o["value"] for o in part["outputs"]), outs))
                for check in program["checks"]:
                    got = env[check["value"]].item()
                    if type(got) is not type(check["equals"]) or got != check["equals"]:
                        raise BundleError(
                            f"these inputs take another path through the model than the captured ones: the model "
                            f"reads the value of {check['op']} at {check['at']} to decide what to do next; it was "
                            f"{check['equals']!r} when captured and is {got!r} now. Capture again with inputs like these")
            return {o["name"]: self._source(o["from"], env, given) for o in self.manifest["outputs"]}

    def _run(self, k: int, j: int, part: dict, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            outs = self._runners[k, j][0](inputs)
        except Exception as e:
            raise BundleError(f"partition {j} of graph {k} ({part['delegate']}, {part['ops']} ops, "
                              f"{part['artifact']}) failed: {type(e).__name__}: {e}") from e
        fixed = []
        for v, o in zip(outs, part["outputs"]):
            if list(v.shape) != o["shape"] or str(v.dtype).removeprefix("torch.") != o["dtype"]:
                raise BundleError(f"partition {j} of graph {k} ({part['delegate']}) returned {_describe(v.dtype, v.shape)} "
                                  f"for {o['value']}, the manifest says {_describe(o['dtype'], o['shape'])}")
            if list(v.stride()) != o["stride"] and v.numel() > 1 and 0 not in o["stride"]:
                v = torch.empty_strided(v.shape, o["stride"], dtype=v.dtype).copy_(v)  # eager's layout, as in Program
            fixed.append(v)
        return fixed


def load(path: str | Path) -> Bundle:
    """Load and check a bundle written by `torchnative capture-and-compile`."""
    return Bundle(path)

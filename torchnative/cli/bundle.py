"""`torchnative capture-and-compile` (model → bundle) and `torchnative run` (bundle → outputs)."""
from __future__ import annotations

import fnmatch
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click
import torch

from torchnative.interface import Tolerance
from torchnative.models import DEFAULT_MODEL


def _model(spec: str, config: str) -> tuple[torch.nn.Module, dict | None, str]:
    """(model, example inputs the factory gave or None, a description for the manifest)."""
    from torchnative import models

    if spec.startswith("transformers:"):
        arch = spec.removeprefix("transformers:")
        return models.transformers_model(arch, config), None, f"{spec} --config {config}"
    made = models.from_file(spec)
    model, inputs = made if isinstance(made, tuple) else (made, None)
    if not isinstance(model, torch.nn.Module):
        raise models.ModelSpecError(f"{spec} returned a {type(model).__name__}, not a torch.nn.Module")
    return model, inputs, spec


def _inputs(model: torch.nn.Module, given: dict | None, specs: tuple[str, ...]) -> dict[str, torch.Tensor]:
    from torchnative import models

    if specs:
        parsed = [models.parse_input(s) for s in specs]
        return {name: models.random_input(name, dtype, shape, model) for name, dtype, shape in parsed}
    return given if given is not None else models.default_inputs(model)


def _pin(model: torch.nn.Module, patterns: tuple[str, ...]) -> list[str]:
    import torchnative

    named = dict(model.named_parameters()) | dict(model.named_buffers())
    chosen = []
    for pattern in patterns:
        hits = [n for n in named if fnmatch.fnmatchcase(n, pattern)]
        if not hits:
            raise click.UsageError(f"--pin {pattern!r} matches no parameter or buffer; names look like "
                                   f"{', '.join(list(named)[:4])}")
        for n in hits:
            torchnative.pin(named[n])
        chosen += hits
    return chosen


def _progress():
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    from torchnative.inspector.report import console
    return Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), console=console(stderr=True), transient=False)


def per_delegate(built: Built) -> dict[str, Counter]:
    """Per delegate that built partitions: partitions, ops, build seconds, KiB in the bundle and
    the worst gap from eager the build's check measured ("x (eager here)": a compile-only
    delegate's partitions, which eager runs on this machine)."""
    from torchnative.bundle.build import CompiledMethod

    per: dict[str, Counter] = {}
    for call in (c for m in built.compiled.methods.values() if isinstance(m, CompiledMethod) for c in m.trace.calls):
        for s in call.program.steps:
            made = s.artifact.delegate if s.artifact is not None else s.delegate
            c = per.setdefault(made if made == s.delegate else f"{made} (eager here)", Counter())
            c["partitions"] += 1
            c["ops"] += len(s.graph.op_nodes())
            c["seconds"] += s.compile_s
            if s.verdict is not None:
                c["gap"] = max(c.get("gap", 0.0), s.verdict.gap)
    sizes = Counter()
    for name, data in built.files.items():
        sizes[name.rsplit("_", 1)[-1].split(".")[0] if name.startswith("partitions/") else name] += len(data)
    for d, c in per.items():
        c["KiB"] = sizes.get(d.split(" ")[0], 0) / 1024
    return per


def _summary(built: Built):
    from rich.table import Table
    from rich.text import Text

    from torchnative.bundle.build import CompiledMethod

    compiled, fallbacks, pinned, files, path = built.compiled, built.fallbacks, built.pinned, built.files, built.path
    methods = {name: m for name, m in compiled.methods.items() if isinstance(m, CompiledMethod)}  # not the buckets' dispatch
    declined: Counter = Counter()
    for call in (c for m in methods.values() for c in m.trace.calls):
        declined.update((op, d, why) for op, d, why in call.program.declined)
    per = per_delegate(built)
    total_ops = sum(c["ops"] for c in per.values()) or 1
    graphs = ", ".join(f"{name} {len(m.trace.calls)}" for name, m in methods.items())
    table = Table(title=f"graphs per method: {graphs}; {built.seconds:.1f} s")
    for col in ("delegate", "partitions", "ops", "coverage", "build s", "KiB", "worst gap"):
        table.add_column(col, justify="left" if col == "delegate" else "right")
    for d, c in sorted(per.items(), key=lambda kv: -kv[1]["ops"]):
        table.add_row(d, str(c["partitions"]), str(c["ops"]), f"{100 * c['ops'] / total_ops:.0f}%",
                      f"{c['seconds']:.2f}", f"{c['KiB']:.0f}", f"{c['gap']:.1e}" if "gap" in c else "-")
    rows = [Text(f"bundle {path}"), table]
    other = Table(title="also in the bundle")
    other.add_column("what")
    other.add_column("detail")
    other.add_row("weights", f"{len(files['weights.safetensors']) / 1024:.0f} KiB: weights partitions take at load or run time (the rest are compiled into artifacts)")
    other.add_row("pinned", ", ".join(pinned) or "none")
    states = [t for _, t in compiled.states.values()]
    other.add_row("state", f"{len(states)} tensors, {sum(t.nbytes for t in states) / 1024:.0f} KiB (the KV cache: "
                           f"made at load, written by the methods)" if states else "none")
    reasons = Counter(f"{f.delegate}: {f.reason.splitlines()[0][:160]}" for f in fallbacks)
    other.add_row("fallbacks", "; ".join(f"{n}× {why}" for why, n in reasons.items()) or "none")
    for (op, d, why), n in declined.most_common(8):
        other.add_row(f"declined by {d}", f"{n}× {op}: {why[:120]}")
    for note in compiled.notes:
        other.add_row("note", note)
    other.add_row("check", "; ".join(f"{k} {v:.1e}" if isinstance(v, float) else f"{k} {v}" for k, v in built.diffs.items())
                  + " (the saved bundle, loaded back, vs eager)")
    rows.append(other)
    return rows


@click.command("capture-and-compile")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--config", default="tiny", show_default=True, help="transformers config: a preset (tiny, base) or a JSON file")
@click.option("--example-input", "example_inputs", multiple=True, metavar="NAME=DTYPE[SHAPE]",
              help="an input and its shape, e.g. input_ids=int64[1,128] (repeatable; default: the model's usual inputs)")
@click.option("--targets", default=None, help="delegates in preference order, e.g. ort,xnnpack (default: the fastest measured here)")
@click.option("--quantize", type=click.Choice(["int8", "int4", "palettize4"]), default=None, help="weight quantization (pinned weights stay float)")
@click.option("--pin", "pins", multiple=True, metavar="GLOB", help="keep matching parameters updatable: inputs, never compiled in")
@click.option("--out", default=None, help="bundle path: a directory, or a file ending in .zip (default: <model>.bundle)")
@click.option("--generate/--no-generate", "generate", default=None,
              help="a causal LM's prefill and decode methods over a static KV cache (default for a causal LM), "
                   "or one call of the model")
@click.option("--cache-len", default=128, show_default=True, help="KV cache positions (prompt + new tokens) of a generating bundle")
@click.option("--prefill-len", default=16, show_default=True, help="tokens per prefill call of a generating bundle")
@click.option("--dynamic", default=None, metavar="NAME:DIM[,NAME:DIM...]=LOW..HIGH",
              help="input dims that share one size, and its range: the bundle takes any size in it, e.g. "
                   "input_ids:1,attention_mask:1=2..512")
def capture_and_compile(model: str, config: str, example_inputs: tuple[str, ...], targets: str | None,
                        quantize: str | None, pins: tuple[str, ...], out: str | None, generate: bool | None,
                        cache_len: int, prefill_len: int, dynamic: str | None) -> int:
    """Capture MODEL, compile its graphs for the targets, and write a bundle that runs without
    the model's Python code: a causal LM's prefill and decode over a static KV cache (the
    bundle's state; `torchnative run BUNDLE --generate N`), else one call of the model.

    MODEL is transformers:<ArchitectureClass> (with --config) or path/to/file.py:factory, where
    factory() returns a module, or (module, dict of example inputs). Default: a tiny GPT-2.
    """
    from torchnative.bundle import BundleError
    from torchnative.models import ModelSpecError

    try:
        return _capture_and_compile(model, config, example_inputs, targets, quantize, pins, out, generate,
                                    cache_len, prefill_len, dynamic)
    except (BundleError, ModelSpecError) as e:
        click.echo(f"torchnative capture-and-compile: {e}", err=True)
        return 2


@dataclass
class Built:
    """A bundle written and checked: what `capture-and-compile` shows, and a matrix cell reports."""
    compiled: Any          # bundle.build.Compiled
    net: torch.nn.Module
    path: Path | str
    files: dict[str, bytes]
    fallbacks: list
    pinned: list[str]
    inputs: dict[str, torch.Tensor]  # a one-call bundle's example inputs ({} for a generating one)
    generate: bool
    diffs: dict            # the bundle loaded back vs eager
    matches: bool          # ... within the check's tolerance
    seconds: float


class _Silent:
    """Progress that shows nothing (a matrix cell's build on a worker)."""

    def add_task(self, *args, **kwargs) -> int:
        return 0

    def update(self, *args, **kwargs) -> None:
        pass


def build_bundle(model: str, config: str = "tiny", targets: str | None = None, quantize: str | None = None,
                 out: str | None = None, generate: bool | None = None, pins: tuple[str, ...] = (),
                 example_inputs: tuple[str, ...] = (), cache_len: int = 128, prefill_len: int = 16,
                 dynamic: str | None = None, progress: Any = None) -> Built:
    """Capture MODEL, compile it for the targets, write the bundle at `out` (a path or URL), load it
    back and check it against eager; `progress`: a rich Progress to follow it (or none)."""
    from torchnative import events
    from torchnative.bundle import load
    from torchnative.bundle.build import compile_call, compile_generation, generates
    from torchnative.bundle.dynamic import parse as parse_dynamic
    from torchnative.bundle.save import save

    started = time.perf_counter()
    progress = progress or _Silent()
    fallbacks: list = []
    target_list = targets.split(",") if targets else None
    task = progress.add_task(f"building {model}", total=None)
    net, given, described = _model(model, config)
    generate = generates(net) if generate is None else generate
    if generate and (example_inputs or dynamic):
        raise click.UsageError("a generating bundle takes token ids of --prefill-len and 1 tokens (a prompt of any "
                               "length runs in chunks); --example-input and --dynamic are for one call (--no-generate)")
    pinned = _pin(net, pins)
    tasks: dict[str, int] = {}

    def follow(event) -> None:
        if isinstance(event, events.Fallback):
            fallbacks.append(event)
        elif isinstance(event, events.Partitioned):
            parts = Counter(d for d, _ in event.partitions)
            tasks[event.graph_key] = progress.add_task(
                f"compiling graph {len(tasks)}: " + ", ".join(f"{n} {d}" for d, n in parts.items()),
                total=len(event.partitions))
        elif isinstance(event, events.PartitionLowered) and event.graph_key in tasks:
            progress.update(tasks[event.graph_key], advance=1)

    stop = events.listen(follow)
    try:
        if generate:
            progress.update(task, description="capturing prefill and decode over a static KV cache")
            result = compile_generation(net, target_list, quantize, cache_len, prefill_len)
            inputs = {}
        else:
            inputs = _inputs(net, given, example_inputs)
            sized = parse_dynamic(dynamic) if dynamic else None
            progress.update(task, description="capturing one call (eager)" + (" at three sizes" if sized else ""))
            result = compile_call(net, inputs, target_list, quantize, sized)
    finally:
        stop()
    progress.update(task, total=1, completed=1)
    path = out or f"{type(net).__name__}.bundle"
    saving = progress.add_task(f"saving {path}", total=None)
    path, files = save(result, path, described, lambda name, size: progress.update(saving, advance=size))
    progress.update(saving, total=sum(map(len, files.values())), completed=sum(map(len, files.values())))
    checking = progress.add_task("loading the bundle back and checking it against eager", total=1)
    if generate:
        diffs = _generate_check(net, load(path), result)
        matches = all("identical" in v for v in diffs.values())
    else:
        tolerance = _tolerance(result, quantize)
        diffs = _forward_check(load(path), result, tolerance)
        matches = all(v <= tolerance.bound for v in diffs.values())
    progress.update(checking, advance=1)
    return Built(result, net, path, files, fallbacks, pinned, inputs, generate, diffs, matches, time.perf_counter() - started)


# how far a whole bundle's outputs may be from eager's and match: float32 kernels' rounding over
# a model's partitions, or the error of weights quantized to 8 and 4 bits
_WHOLE = {None: Tolerance("scale", 1e-3, "float32 kernels' rounding over the model's partitions"),
          "int8": Tolerance("scale", 0.05, "int8 weights"), "int4": Tolerance("scale", 0.2, "int4 weights"),
          "palettize4": Tolerance("scale", 0.2, "4-bit palettized weights")}


def _tolerance(compiled, quantize: str | None) -> Tolerance:
    """The loosest of the weights' scheme and what the partitions' delegates state (HTP's
    quantized activations: a relative L2 bound)."""
    from torchnative.build.verify import tolerance_of
    from torchnative.bundle.build import CompiledMethod
    from torchnative.delegates import REGISTRY

    stated = [tolerance_of(REGISTRY[s.delegate], s.graph) for m in compiled.methods.values()
              if isinstance(m, CompiledMethod) for c in m.trace.calls for s in c.program.steps if s.delegate in REGISTRY]
    return max([_WHOLE[quantize], *stated], key=lambda t: t.bound)


def _capture_and_compile(model: str, config: str, example_inputs: tuple[str, ...], targets: str | None,
                         quantize: str | None, pins: tuple[str, ...], out: str | None, generate: bool | None,
                         cache_len: int, prefill_len: int, dynamic: str | None) -> int:
    from torchnative.inspector.report import console, show

    con = console()
    with _progress() as progress:
        built = build_bundle(model, config, targets, quantize, out, generate, pins, example_inputs, cache_len,
                             prefill_len, dynamic, progress)
    show(con, _summary(built))
    if built.generate:
        click.echo(f"run it: torchnative run {built.path} --generate 32")
    else:
        click.echo(f"run it: torchnative run {built.path} " + " ".join(f"--input {n}=random" for n in built.inputs))
    return 0


def _forward_check(loaded, compiled, tolerance: Tolerance) -> dict:
    from torchnative.build.verify import gap

    forward = compiled.methods["forward"]
    outputs = loaded(**forward.inputs)
    measure = "max rel diff" if tolerance.kind == "scale" else "rel L2"
    return {f"{name} {measure} (≤ {tolerance.bound:g}: {tolerance.why})": gap(outputs[name], ref, tolerance.kind)
            for name, ref in zip(forward.output_names, forward.reference)}


def _generate_check(net: torch.nn.Module, loaded, compiled, new_tokens: int = 8) -> dict:
    """Greedy tokens of the bundle vs the eager model's `generate` on a prompt of 1.5 prefills
    (a prefill call and decode calls for the rest of it; an encoder-decoder's: a padded one)."""
    spec = compiled.generation
    n = spec["prefill_len"] - 1 if "encode" in spec else min(spec["prefill_len"] * 3 // 2, spec["cache_len"] - new_tokens)
    # no token 0 or 1: transformers masks a prompt's pad tokens (often 0) when it holds any
    ids = torch.randint(2, net.config.vocab_size, (1, max(n, 1)), generator=torch.Generator().manual_seed(2))
    got = loaded.generate(ids, max_new_tokens=new_tokens)
    with torch.no_grad():
        ref = net.generate(ids, max_new_tokens=new_tokens, do_sample=False, use_cache=True)
    same = got.shape == ref.shape and torch.equal(got, ref)
    return {f"greedy tokens ({new_tokens} for a {ids.shape[1]}-token prompt)":
            "identical to model.generate" if same else f"DIFFER from model.generate: {got[0, ids.shape[1]:].tolist()} "
                                                        f"vs {ref[0, ids.shape[1]:].tolist()}"}


def _read_input(spec: str, expected: dict) -> tuple[str, torch.Tensor]:
    import numpy as np

    name, _, source = spec.partition("=")
    if name not in expected:
        raise click.UsageError(f"--input {spec!r}: the bundle takes {sorted(expected)}")
    if source == "random":
        return name, _random(expected, name)
    if not source.endswith(".npy") or not Path(source).is_file():
        raise click.UsageError(f"--input {spec!r}: expected {name}=file.npy (an existing file) or {name}=random")
    return name, torch.from_numpy(np.load(source))


def _random(expected: dict, name: str) -> torch.Tensor:
    dtype, shape, low_high = expected[name]
    g = torch.Generator().manual_seed(0)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    low, high = low_high or (0, 1)
    return torch.randint(low, high + 1, shape, generator=g).to(dtype)


@click.command("run")
@click.argument("bundle")
@click.option("--input", "inputs", multiple=True, metavar="NAME=FILE.npy|random", help="an input (repeatable); unnamed inputs are random")
@click.option("--save", "save_to", default=None, metavar="FILE.npz", help="write the outputs (or the tokens) to a .npz file")
@click.option("--method", default=None, help="the method to call, of a bundle with several (default: its only one)")
@click.option("--generate", "new_tokens", type=int, default=None, metavar="N",
              help="greedy-decode N tokens after the prompt --input input_ids=prompt.npy (a generating bundle)")
def run(bundle: str, inputs: tuple[str, ...], save_to: str | None, method: str | None, new_tokens: int | None) -> int:
    """Run a bundle written by capture-and-compile, without the model's code."""
    from torchnative.bundle import BundleError, load

    try:
        loaded = load(bundle)
        if new_tokens is not None:
            return _generate(loaded, bundle, inputs, new_tokens, save_to)
        return _call(loaded, bundle, inputs, method, save_to)
    except BundleError as e:
        click.echo(f"torchnative run: {e}", err=True)
        return 2


def _expected(method) -> dict:
    """Each input's dtype, shape (a dynamic one's at the size it was captured with) and value range."""
    from torchnative.bundle.dynamic import evaluate

    ranges = {i.name: i.range for i in method.spec.inputs}
    n = method.size["example"] if method.size else 0
    return {k: (dtype, tuple(evaluate(x, n) for x in shape), ranges[k]) for k, (dtype, shape) in method.inputs.items()}


def _call(loaded, bundle: str, inputs: tuple[str, ...], name: str | None, save_to: str | None) -> int:
    import numpy as np
    from rich.table import Table

    from torchnative.inspector.report import console, show

    if name is None and len(loaded.methods) > 1:
        raise click.UsageError(f"{bundle} has methods {sorted(loaded.methods)}: choose one with --method"
                               + (", or generate with --generate N" if "generate" in loaded.manifest else ""))
    if name is not None and name not in loaded.methods:
        raise click.UsageError(f"--method {name!r}: {bundle} has methods {sorted(loaded.methods)}")
    method = loaded.methods[name or next(iter(loaded.methods))]
    expected = _expected(method)
    given = dict(_read_input(s, expected) for s in inputs)
    for n in expected:
        if n not in given:
            given[n] = _random(expected, n)
            click.echo(f"{n}: random {str(expected[n][0]).removeprefix('torch.')}{list(expected[n][1])}", err=True)
    started = time.perf_counter()
    outputs = method(**given)
    seconds = time.perf_counter() - started
    table = Table(title=f"{bundle}: outputs ({seconds * 1e3:.1f} ms)")
    for col in ("output", "dtype", "shape", "mean", "std", "min", "max"):
        table.add_column(col)
    for n, v in outputs.items():
        f = v.double()
        table.add_row(n, str(v.dtype).removeprefix("torch."), str(list(v.shape)), f"{f.mean():.4g}",
                      f"{f.std():.4g}" if v.numel() > 1 else "-", f"{f.min():.4g}", f"{f.max():.4g}")
    show(console(), [table])
    if save_to:
        np.savez(save_to, **{n: v.numpy() for n, v in outputs.items()})
        click.echo(f"outputs written to {save_to}")
    return 0


def _generate(loaded, bundle: str, inputs: tuple[str, ...], new_tokens: int, save_to: str | None) -> int:
    import numpy as np

    spec = loaded.manifest.get("generate")
    if spec is None:
        raise click.UsageError(f"{bundle} does not generate (methods {sorted(loaded.methods)}): run it without --generate")
    first = loaded.methods[spec.get("prefill") or spec["encode"]]  # the method that takes the prompt
    dtype, _, token_range = _expected(first)[spec["tokens"]]
    expected = {spec["tokens"]: (dtype, (1, spec["prefill_len"]), token_range)}
    given = dict(_read_input(s, expected) for s in inputs)
    if spec["tokens"] not in given:
        given[spec["tokens"]] = _random(expected, spec["tokens"])
        click.echo(f"{spec['tokens']}: a random prompt of {spec['prefill_len']} tokens", err=True)
    prompt = given[spec["tokens"]]
    prompt = prompt.reshape(1, -1) if prompt.dim() == 1 else prompt
    times: list[float] = []
    started = time.perf_counter()
    tokens = loaded.generate(prompt.long(), max_new_tokens=new_tokens, on_token=lambda t: times.append(time.perf_counter()))
    new = tokens[0, 1 if "encode" in spec else prompt.shape[1]:].tolist()  # an encoder-decoder's: after the start token
    click.echo(" ".join(map(str, new)))
    if times:
        first = times[0] - started
        rate = f"{(len(times) - 1) / (times[-1] - times[0]):.1f} tokens/s" if len(times) > 1 else "-"
        click.echo(f"{len(new)} new tokens after a {prompt.shape[1]}-token prompt: first in {first * 1e3:.1f} ms "
                   f"(prefill), then {rate} (decode)", err=True)
    if save_to:
        np.savez(save_to, tokens=tokens.numpy())
        click.echo(f"tokens written to {save_to}")
    return 0

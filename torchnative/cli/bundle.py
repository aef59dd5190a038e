"""`torchnative capture-and-compile` (model → bundle) and `torchnative run` (bundle → outputs)."""
from __future__ import annotations

import fnmatch
import time
from collections import Counter
from pathlib import Path

import click
import torch

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


def _summary(compiled, fallbacks: list, pinned: list[str], files: dict[str, bytes], path: Path,
             seconds: float, diffs: dict[str, float]):
    from rich.table import Table

    per: dict[str, Counter] = {}
    declined: Counter = Counter()
    for step in compiled.trace.steps:
        declined.update((op, d, why) for op, d, why in step.program.declined)
        for s in step.program.steps:
            # a compile-only delegate's partition ships its artifact; eager runs it here
            built = s.artifact.delegate if s.artifact is not None else s.delegate
            c = per.setdefault(built if built == s.delegate else f"{built} (eager here)", Counter())
            c["partitions"] += 1
            c["ops"] += len(s.graph.op_nodes())
            c["seconds"] += s.compile_s
    total_ops = sum(c["ops"] for c in per.values()) or 1
    sizes = Counter()
    for name, data in files.items():
        sizes[name.rsplit("_", 1)[-1].split(".")[0] if name.startswith("partitions/") else name] += len(data)
    table = Table(title=f"bundle {path}: {len(compiled.trace.steps)} graph(s), {seconds:.1f} s")
    for col in ("delegate", "partitions", "ops", "coverage", "compile s", "artifact KiB"):
        table.add_column(col, justify="left" if col == "delegate" else "right")
    for d, c in sorted(per.items(), key=lambda kv: -kv[1]["ops"]):
        table.add_row(d, str(c["partitions"]), str(c["ops"]), f"{100 * c['ops'] / total_ops:.0f}%",
                      f"{c['seconds']:.2f}", f"{sizes.get(d.split(' ')[0], 0) / 1024:.0f}")
    rows = [table]
    other = Table(title="also in the bundle")
    other.add_column("what")
    other.add_column("detail")
    other.add_row("weights", f"{len(files['weights.safetensors']) / 1024:.0f} KiB: weights partitions take at load or run time (the rest are compiled into artifacts)")
    other.add_row("pinned", ", ".join(pinned) or "none")
    other.add_row("state", "none (bundles carry no state yet)")
    reasons = Counter(f"{f.delegate}: {f.reason.splitlines()[0][:160]}" for f in fallbacks)
    other.add_row("fallbacks", "; ".join(f"{n}× {why}" for why, n in reasons.items()) or "none")
    for (op, d, why), n in declined.most_common(8):
        other.add_row(f"declined by {d}", f"{n}× {op}: {why[:120]}")
    other.add_row("check", "; ".join(f"{k} max rel diff {v:.1e}" for k, v in diffs.items())
                  + " (the saved bundle, loaded back, vs eager)")
    rows.append(other)
    return rows


def _rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    if not a.dtype.is_floating_point:
        return float((a != b).any())
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-12)).item()


@click.command("capture-and-compile")
@click.argument("model", required=False, default=DEFAULT_MODEL)
@click.option("--config", default="tiny", show_default=True, help="transformers config: a preset (tiny, base) or a JSON file")
@click.option("--example-input", "example_inputs", multiple=True, metavar="NAME=DTYPE[SHAPE]",
              help="an input and its shape, e.g. input_ids=int64[1,128] (repeatable; default: the model's usual inputs)")
@click.option("--targets", default=None, help="delegates in preference order, e.g. ort,xnnpack (default: the fastest measured here)")
@click.option("--quantize", type=click.Choice(["int8", "int4"]), default=None, help="weight quantization (pinned weights stay float)")
@click.option("--pin", "pins", multiple=True, metavar="GLOB", help="keep matching parameters updatable: inputs, never compiled in")
@click.option("--out", default=None, help="bundle path: a directory, or a file ending in .zip (default: <model>.bundle)")
def capture_and_compile(model: str, config: str, example_inputs: tuple[str, ...], targets: str | None,
                        quantize: str | None, pins: tuple[str, ...], out: str | None) -> int:
    """Capture one call of MODEL, compile its graphs for the targets, and write a bundle that runs
    without the model's Python code.

    MODEL is transformers:<ArchitectureClass> (with --config) or path/to/file.py:factory, where
    factory() returns a module, or (module, dict of example inputs). Default: a tiny GPT-2.
    """
    from torchnative.bundle import BundleError
    from torchnative.models import ModelSpecError

    try:
        return _capture_and_compile(model, config, example_inputs, targets, quantize, pins, out)
    except (BundleError, ModelSpecError) as e:
        click.echo(f"torchnative capture-and-compile: {e}", err=True)
        return 2


def _capture_and_compile(model: str, config: str, example_inputs: tuple[str, ...], targets: str | None,
                         quantize: str | None, pins: tuple[str, ...], out: str | None) -> int:
    from torchnative import events
    from torchnative.bundle import load
    from torchnative.bundle.build import capture_call, compile_trace, compiled, prepare_model
    from torchnative.bundle.save import save
    from torchnative.inspector.report import console

    started = time.perf_counter()
    fallbacks: list = []
    con = console()
    with _progress() as progress:
        task = progress.add_task(f"building {model}", total=None)
        net, given, described = _model(model, config)
        inputs = _inputs(net, given, example_inputs)
        pinned = _pin(net, pins)
        reference = prepare_model(net, inputs)
        progress.update(task, description="capturing one call (eager)")
        trace, run_inputs, output = capture_call(net, inputs)
        progress.update(task, total=1, completed=1, description=f"captured {len(trace.steps)} graph(s)")
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
            trace = compile_trace(trace, run_inputs, targets.split(",") if targets else None, quantize)
        finally:
            stop()
        result = compiled(net, inputs, trace, output, reference)
        path = Path(out or f"{type(net).__name__}.bundle")
        saving = progress.add_task(f"saving {path}", total=None)
        path, files = save(result, path, described, lambda name, size: progress.update(saving, advance=size))
        progress.update(saving, total=sum(map(len, files.values())), completed=sum(map(len, files.values())))
        checking = progress.add_task("loading the bundle back and checking it against eager", total=1)
        outputs = load(path)(**inputs)
        diffs = {name: _rel_diff(outputs[name], ref) for name, ref in zip(result.output_names, reference)}
        progress.update(checking, advance=1)
    for item in _summary(result, fallbacks, pinned, files, path, time.perf_counter() - started, diffs):
        con.print(item)
    click.echo(f"run it: torchnative run {path} " + " ".join(f"--input {n}=random" for n in inputs))
    return 0


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
@click.option("--save", "save_to", default=None, metavar="FILE.npz", help="write the outputs to a .npz file")
def run(bundle: str, inputs: tuple[str, ...], save_to: str | None) -> int:
    """Run a bundle written by capture-and-compile, without the model's code."""
    import numpy as np
    from rich.table import Table

    from torchnative.bundle import BundleError, load
    from torchnative.inspector.report import console

    try:
        loaded = load(bundle)
    except BundleError as e:
        click.echo(f"torchnative run: {e}", err=True)
        return 2
    ranges = {i["name"]: i.get("range") for i in loaded.manifest["inputs"]}
    expected = {n: (dtype, shape, ranges[n]) for n, (dtype, shape) in loaded.inputs.items()}
    given = dict(_read_input(s, expected) for s in inputs)
    for name in expected:
        if name not in given:
            given[name] = _random(expected, name)
            click.echo(f"{name}: random {str(expected[name][0]).removeprefix('torch.')}{list(expected[name][1])}", err=True)
    try:
        started = time.perf_counter()
        outputs = loaded(**given)
        seconds = time.perf_counter() - started
    except BundleError as e:
        click.echo(f"torchnative run: {e}", err=True)
        return 2
    table = Table(title=f"{bundle}: outputs ({seconds * 1e3:.1f} ms)")
    for col in ("output", "dtype", "shape", "mean", "std", "min", "max"):
        table.add_column(col)
    for name, v in outputs.items():
        f = v.double()
        table.add_row(name, str(v.dtype).removeprefix("torch."), str(list(v.shape)), f"{f.mean():.4g}",
                      f"{f.std():.4g}" if v.numel() > 1 else "-", f"{f.min():.4g}", f"{f.max():.4g}")
    console().print(table)
    if save_to:
        np.savez(save_to, **{n: v.numpy() for n, v in outputs.items()})
        click.echo(f"outputs written to {save_to}")
    return 0

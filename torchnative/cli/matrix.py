"""`torchnative compile-matrix MATRIX.toml`: every model × target × quantization a bundle, one Ray
task per cell (a local Ray instance, or a cluster at `--address`), the workers sharing the cache
(store.py: `cache = "s3://…"`) so a cell compiled once anywhere is a download everywhere after.

A cell is independent of every other: it builds on its worker exactly as `capture-and-compile`
does (cli/bundle.py: capture, compile, write the bundle, load it back and check it against
eager) and returns one row. A cell that fails is a row with its error; a worker that dies mid-cell
is retried by Ray (the row counts the attempts, kept by an actor outside the workers)."""
from __future__ import annotations

import contextlib
import json
import os
import shlex
import time
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import click

from torchnative.cli.bundle import _progress

# what a worker needs of the driver's environment: where the cache and buckets are and how to reach them
_FORWARDED = ("TORCHNATIVE_", "AWS_", "FSSPEC_", "GOOGLE_", "AZURE_", "PYTHONPATH", "GOMP_SPINCOUNT")
_RETRIES = 2  # a worker that dies (killed, out of memory, a crash in a toolchain) is replaced this many times


@dataclass(frozen=True)
class Cell:
    model: str       # transformers:Class or path/to/file.py:factory (absolute)
    config: str
    target: str
    quantize: str | None

    @property
    def name(self) -> str:
        short = self.model.removeprefix("transformers:").rpartition("/")[2].replace(".py:", ":")
        return f"{short}-{self.target}-{self.quantize or 'float'}"


@dataclass
class Matrix:
    cells: list[Cell]
    out: str                    # where bundles go: a directory or a URL
    cache: str | None           # the shared cache (None: each worker's own TORCHNATIVE_CACHE_DIR)
    options: dict = field(default_factory=dict)  # capture-and-compile's, for every cell


class MatrixError(ValueError):
    """The matrix file is wrong; the message says where."""


def read(path: Path) -> Matrix:
    """The matrix file: `models` (each "transformers:Class [--config C]" or "file.py:factory",
    relative to the file), `targets`, `quantize` ("float", "int8", "int4"), `out`, `cache`, and an
    `[options]` table (generate, cache_len, prefill_len, pins)."""
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise MatrixError(f"{path}: {e}") from e
    missing = [k for k in ("models", "targets") if not spec.get(k)]
    if missing:
        raise MatrixError(f"{path} needs {' and '.join(missing)} (lists): models = [\"transformers:BertModel\"], "
                          f"targets = [\"ort\"]")
    options = spec.get("options", {})
    unknown = set(options) - {"generate", "cache_len", "prefill_len", "pins"}
    if unknown:
        raise MatrixError(f"{path}: [options] has {sorted(unknown)}; it takes generate, cache_len, prefill_len, pins")
    schemes = [None if q in ("float", "none") else q for q in spec.get("quantize", ["float"])]
    if not set(schemes) <= {None, "int8", "int4"}:
        raise MatrixError(f"{path}: quantize takes float, int8 and int4, not {spec['quantize']}")
    models = [_model(m, path.parent) for m in spec["models"]]
    cells = [Cell(model, config, target, q) for model, config in models for target in spec["targets"] for q in schemes]
    out = spec.get("out", "matrix-bundles")
    if "://" not in out and not Path(out).is_absolute():
        out = str(path.parent / out)
    return Matrix(cells, out.rstrip("/"), spec.get("cache"), options)


def _model(text: str, base: Path) -> tuple[str, str]:
    words = shlex.split(text)
    spec, config = words[0], "tiny"
    if words[1:3] and words[1] == "--config" and len(words) == 3:
        config = words[2]
    elif len(words) > 1:
        raise MatrixError(f"model {text!r}: expected \"transformers:Class [--config C]\" or \"file.py:factory\"")
    if not spec.startswith("transformers:"):
        file, _, factory = spec.rpartition(":")
        spec = f"{(base / file).resolve()}:{factory}"  # the worker's working directory is not the driver's
    return spec, config


def run_cell(cell: Cell, out: str, cache: str | None, options: dict, started: Callable[[], int]) -> dict:
    """Build one cell's bundle (in this process) and describe it as a row; never raises."""
    import torchnative
    from torchnative import store
    from torchnative.cache.program_cache import clear_caches
    from torchnative.cli.bundle import build_bundle, per_delegate

    attempt = started()
    t0 = time.perf_counter()
    row: dict[str, Any] = {"cell": cell.name, "model": cell.model, "config": cell.config, "target": cell.target,
                           "quantize": cell.quantize or "float", "attempts": attempt, "host": os.uname().nodename}
    with store.placed(cache) if cache is not None else contextlib.nullcontext():
        clear_caches()  # a worker runs many cells: each starts as a new process would, from the shared cache alone
        torchnative.reset_stats()
        try:
            built = build_bundle(cell.model, cell.config, cell.target, cell.quantize, f"{out}/{cell.name}.bundle",
                                 options.get("generate"), tuple(options.get("pins", ())),
                                 cache_len=options.get("cache_len", 128), prefill_len=options.get("prefill_len", 16))
        except Exception as e:  # a failed cell is a row; the others go on
            row.update(status="failed", error=f"{type(e).__name__}: {e}"[:2000], seconds=time.perf_counter() - t0,
                       cache=dict(torchnative.stats()["disk_cache"]))
            return row
    per = per_delegate(built)
    ops = sum(c["ops"] for c in per.values()) or 1
    on_target = per.get(cell.target, {})
    declined = sorted({f"{op}: {why.splitlines()[0][:200]}" for m in built.compiled.methods.values()
                       for c in getattr(getattr(m, "trace", None), "calls", ())
                       for op, d, why in c.program.declined if d == cell.target})
    refusal = [f"{f.delegate}: {f.reason.splitlines()[0][:200]}" for f in built.fallbacks] + declined
    row.update(
        status="ok" if built.matches and on_target.get("ops") else "refused" if built.matches else "mismatch",
        bundle=str(built.path), bytes=sum(map(len, built.files.values())),
        partitions={d: c["partitions"] for d, c in per.items()},
        coverage=on_target.get("ops", 0) / ops, compile_s=sum(c["seconds"] for c in per.values()),
        check=built.diffs, matches=built.matches, refusal=refusal[:5],
        seconds=time.perf_counter() - t0, cache=dict(torchnative.stats()["disk_cache"]))
    return row


def run_serial(matrix: Matrix, on_row: Callable[[dict], None]) -> list[dict]:
    """Every cell in this process, one after another (the baseline Ray is measured against)."""
    rows = []
    for cell in matrix.cells:
        rows.append(run_cell(cell, matrix.out, matrix.cache, matrix.options, lambda: 1))
        on_row(rows[-1])
    return rows


def run_on_ray(matrix: Matrix, address: str | None, workers: int | None, on_progress: Callable[[dict], None]) -> list[dict]:
    """One Ray task per cell; `on_progress({"done", "running", "failed", "queued"})` as they go."""
    try:
        import ray
    except ImportError as e:
        raise click.UsageError("compile-matrix runs on Ray: pip install 'torchnative[scale]' (or --serial)") from e
    env = {k: v for k, v in os.environ.items() if k.startswith(_FORWARDED)}
    started_here = not ray.is_initialized()
    if started_here:
        local = {} if address else {"num_cpus": workers or os.cpu_count()}
        ray.init(address=address, include_dashboard=False, log_to_driver=False, configure_logging=False,
                 runtime_env={"env_vars": env}, **local)
    try:
        return _run_tasks(ray, matrix, on_progress)
    finally:
        if started_here:
            ray.shutdown()


def _run_tasks(ray, matrix: Matrix, on_progress: Callable[[dict], None]) -> list[dict]:
    @ray.remote(num_cpus=0)
    class Attempts:
        """Cells' starts, counted outside the workers (a dead worker's count survives it)."""

        def __init__(self):
            self.starts: dict[str, int] = {}

        def start(self, name: str) -> int:
            self.starts[name] = self.starts.get(name, 0) + 1
            return self.starts[name]

        def all(self) -> dict[str, int]:
            return self.starts

    @ray.remote(num_cpus=1, max_retries=_RETRIES, retry_exceptions=False)
    def cell_task(cell: Cell, out: str, cache: str | None, options: dict, attempts) -> dict:
        return run_cell(cell, out, cache, options, lambda: ray.get(attempts.start.remote(cell.name)))

    attempts = Attempts.remote()
    pending = {cell_task.remote(c, matrix.out, matrix.cache, matrix.options, attempts): c for c in matrix.cells}
    rows: dict[Cell, dict] = {}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1, timeout=0.5)
        for ref in ready:
            cell = pending.pop(ref)
            try:
                rows[cell] = ray.get(ref)
            except ray.exceptions.RayError as e:  # the worker died on every attempt
                starts = ray.get(attempts.all.remote()).get(cell.name, 0)
                rows[cell] = {"cell": cell.name, "model": cell.model, "target": cell.target,
                              "quantize": cell.quantize or "float", "status": "failed", "attempts": starts,
                              "error": f"{type(e).__name__}: {str(e).splitlines()[0][:500]}"}
        starts = ray.get(attempts.all.remote())
        failed = sum(r["status"] == "failed" for r in rows.values())
        running = sum(1 for c in pending.values() if c.name in starts)
        on_progress({"done": len(rows) - failed, "failed": failed, "running": running,
                     "queued": len(pending) - running})
    for cell, row in rows.items():  # a retried cell's row was made by its last attempt, which knows its number
        row["retried"] = row.get("attempts", 1) > 1
    return [rows[c] for c in matrix.cells]


def table(rows: list[dict], seconds: float):
    from rich.table import Table

    t = Table(title=f"compile matrix: {len(rows)} cells, {seconds:.1f} s")
    for col in ("cell", "status", "on target", "partitions", "KiB", "compile s", "cell s", "cache", "check", "note"):
        t.add_column(col, justify="right" if col in ("on target", "KiB", "compile s", "cell s") else "left")
    for r in rows:
        cache = r.get("cache", {})
        note = r.get("error") or "; ".join(r.get("refusal", [])[:2])
        if r.get("attempts", 1) > 1:
            note = f"attempt {r['attempts']} (worker died {r['attempts'] - 1}x, retried by Ray)" + (f"; {note}" if note else "")
        check = "; ".join(f"{v:.1e}" if isinstance(v, float) else str(v) for v in r.get("check", {}).values())
        t.add_row(r["cell"], r["status"], f"{100 * r['coverage']:.0f}%" if "coverage" in r else "-",
                  ", ".join(f"{d} {n}" for d, n in r.get("partitions", {}).items()) or "-",
                  f"{r['bytes'] / 1024:.0f}" if "bytes" in r else "-",
                  f"{r['compile_s']:.2f}" if "compile_s" in r else "-", f"{r.get('seconds', 0):.1f}",
                  ", ".join(f"{k} {v}" for k, v in sorted(cache.items())) or "-", check[:60] or "-", note[:160])
    return t


@click.command("compile-matrix")
@click.argument("matrix_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--address", default=None, help="a Ray cluster's address (default: a local Ray instance on this machine)")
@click.option("--workers", type=int, default=None, help="CPUs of the local Ray instance, one cell each (default: all)")
@click.option("--serial", is_flag=True, help="every cell in this process, no Ray (the baseline)")
@click.option("--json", "json_out", default="matrix.json", show_default=True, help="the rows, as JSON")
def compile_matrix(matrix_file: Path, address: str | None, workers: int | None, serial: bool, json_out: str) -> int:
    """Build a bundle for every model × target × quantization of MATRIX_FILE (TOML), one Ray task
    per cell, sharing a cache. Exit status 1 if a cell failed or its bundle did not match eager.

    \b
    models   = ["transformers:BertModel --config tiny", "nets.py:small_cnn"]
    targets  = ["ort", "xnnpack", "qnn"]
    quantize = ["float", "int8"]
    out      = "s3://team-bucket/bundles"    # or a directory (default: matrix-bundles)
    cache    = "s3://team-bucket/cache"      # shared by every worker (default: each one's own)
    [options]                                # capture-and-compile's, for every cell
    generate = false
    """
    from torchnative.inspector.report import console, show

    try:
        matrix = read(matrix_file)
    except MatrixError as e:
        raise click.UsageError(str(e)) from e
    started = time.perf_counter()
    with _progress() as progress:
        task = progress.add_task(f"{len(matrix.cells)} cells", total=len(matrix.cells))
        if serial:
            seen: list[dict] = []

            def on_row(row: dict) -> None:
                seen.append(row)
                failed = sum(r["status"] == "failed" for r in seen)
                progress.update(task, completed=len(seen), description=f"cells: {len(seen) - failed} done, {failed} failed "
                                                                       f"(last: {row['cell']} {row['status']})")
            rows = run_serial(matrix, on_row)
        else:
            def on_progress(p: dict) -> None:
                progress.update(task, completed=p["done"] + p["failed"],
                                description=f"cells: {p['done']} done, {p['running']} running, {p['failed']} failed, "
                                            f"{p['queued']} queued")
            rows = run_on_ray(matrix, address, workers, on_progress)
    seconds = time.perf_counter() - started
    show(console(), [table(rows, seconds)])
    Path(json_out).write_text(json.dumps({"seconds": seconds, "ray": not serial, "matrix": str(matrix_file),
                                          "rows": rows}, indent=1, default=str))
    click.echo(f"rows written to {json_out}")
    return 0 if all(r["status"] in ("ok", "refused") for r in rows) else 1

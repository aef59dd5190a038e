"""compile-matrix wall time: the same matrix built serially in one process, on a local Ray instance
with 2 workers, and again on Ray with the shared cache warm; the bundles and the cache in a bucket
of a local S3 server (moto). Then the cache's read throughput: every object the runs stored, read
back through the store (frame and hash checked), from the bucket and from a local directory.

    python benchmarks/matrix.py [--models transformers:BertModel,transformers:ViTModel] [--targets ort,xnnpack,qnn]

Each run is `torchnative compile-matrix` in its own process (Ray's start and the imports counted,
as a user waits for them). Prints a table; writes benchmarks/results/matrix.json.
"""
from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write  # noqa: E402


def _matrix(folder: Path, models: list[str], targets: list[str], bucket: str, run: str) -> Path:
    path = folder / f"{run}.toml"
    path.write_text(f"models = {json.dumps([f'{m} --config tiny' for m in models])}\n"
                    f"targets = {json.dumps(targets)}\nquantize = [\"float\", \"int8\"]\n"
                    f"out = \"{bucket}/{run}/bundles\"\ncache = \"{bucket}/{run.split('-')[0]}/cache\"\n"
                    f"[options]\ngenerate = false\n")
    return path


def _run(folder: Path, matrix: Path, *extra: str) -> dict:
    out = folder / f"{matrix.stem}.json"
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "torchnative.cli", "compile-matrix", str(matrix), "--json", str(out), *extra],
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    wall = time.perf_counter() - started
    if done.returncode not in (0, 1) or not out.exists():
        raise SystemExit(f"{matrix.stem} failed:\n{done.stderr[-3000:]}")
    rows = json.loads(out.read_text())["rows"]
    return {"wall s": wall, "rows": rows, "cells": len(rows),
            "ok": sum(r["status"] == "ok" for r in rows), "refused": sum(r["status"] == "refused" for r in rows),
            "failed": sum(r["status"] in ("failed", "mismatch") for r in rows),
            "cell s": sum(r.get("seconds", 0) for r in rows), "compile s": sum(r.get("compile_s", 0) for r in rows),
            "hits": sum(r.get("cache", {}).get("hits", 0) for r in rows),
            "misses": sum(r.get("cache", {}).get("misses", 0) for r in rows)}


def _throughput(place: str) -> dict:
    """Every object at `place` read through the store (frame and hash checked), one after another."""
    from torchnative import store

    store.set_place(place)
    at = store.place()
    names = ([Path(p).name for p in at.fs.find(at.root)] if hasattr(at, "fs")
             else [p.name for p in Path(place).iterdir() if p.is_file()])
    started = time.perf_counter()
    size = sum(len(store.read(n)[1]) for n in names)
    seconds = time.perf_counter() - started
    return {"place": place.split("://")[0] if "://" in place else "local dir", "objects": len(names),
            "MB": size / 1e6, "objects/s": len(names) / seconds, "MB/s": size / 1e6 / seconds}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", default="transformers:BertModel,transformers:ViTModel")
    p.add_argument("--targets", default="ort,xnnpack,qnn")
    p.add_argument("--gap", type=float, default=5.0, help="idle seconds between runs")
    a = p.parse_args()
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # a line per request otherwise
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.update(AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1",
                      AWS_ENDPOINT_URL=f"http://{host}:{port}")
    import s3fs

    name = f"matrix-{uuid.uuid4().hex[:8]}"
    s3fs.S3FileSystem().mkdir(name)
    bucket = f"s3://{name}"
    models, targets = a.models.split(","), a.targets.split(",")
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        plan = [("serial-cold", "serial", ("--serial",)), ("ray2-cold", "ray2", ("--workers", "2")),
                ("ray2-warm", "ray2", ("--workers", "2")), ("serial-warm", "ray2", ("--serial",))]
        for run, cache, extra in plan:
            time.sleep(a.gap)
            matrix = _matrix(folder, models, targets, bucket, f"{cache}-{run}")
            runs[run] = _run(folder, matrix, *extra)
            print(f"{run}: {runs[run]['wall s']:.1f} s", flush=True)
        local = folder / "local-cache"
        from torchnative import store

        store.set_place(f"{bucket}/ray2/cache")
        at = store.place()
        for path in at.fs.find(at.root):  # the same objects in a local directory
            (local / Path(path).name).parent.mkdir(parents=True, exist_ok=True)
            (local / Path(path).name).write_bytes(at.fs.cat_file(path))
        reads = [_throughput(f"{bucket}/ray2/cache"), _throughput(str(local))]
    server.stop()
    serial = runs["serial-cold"]["wall s"]
    rows = [{"run": k, **{c: v[c] for c in ("cells", "ok", "refused", "failed", "hits", "misses")},
             "wall s": v["wall s"], "x serial": serial / v["wall s"], "cell s": v["cell s"], "compile s": v["compile s"]}
            for k, v in runs.items()]
    print(table(rows, [("run", "{}"), ("cells", "{}"), ("ok", "{}"), ("refused", "{}"), ("failed", "{}"),
                       ("wall s", "{:.1f}"), ("x serial", "{:.2f}"), ("cell s", "{:.1f}"), ("compile s", "{:.1f}"),
                       ("hits", "{}"), ("misses", "{}")]))
    print(table(reads, [("place", "{}"), ("objects", "{}"), ("MB", "{:.1f}"), ("objects/s", "{:.0f}"), ("MB/s", "{:.0f}")]))
    print(write("matrix", {"models": models, "targets": targets, "runs": runs, "reads": reads, "cpus": os.cpu_count()}))


if __name__ == "__main__":
    main()

"""Calls made while a compile runs: a Python-heavy eager model (a TTT-style fast-weight forward,
~600 ops) called in a loop while a GPT-2 small graph compiles for ONNX Runtime in the background,
with the compile in a child process (the default, build/apart.py) and on the background thread
(TORCHNATIVE_COMPILE_PROCESS=0). Each mode runs in its own process, in turns.

    python benchmarks/compile_beside.py [--rounds 2] [--model base]

Prints a table; writes benchmarks/results/compile_beside.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write  # noqa: E402

MODES = {"child process": "1", "thread": "0"}


def one(size: str) -> dict:
    """In this process: the loop's call times alone, then while the compile runs."""
    import torchnative  # before torch, as users are told
    import torch
    from torchnative import models
    from torchnative.cache.program_cache import CACHE
    from traffic import TTTModel

    ttt, x = TTTModel(), torch.randn(2, 64, 256)
    with torch.no_grad():
        # the process's first ONNX Runtime compile builds its translation table here (1.7 s of
        # Python, in this process whatever the mode): done first, on a tiny model
        tiny = models.build("gpt2")
        tiny.config.use_cache = False
        torchnative.accelerate(tiny, delegates=["ort"], compile_after=2, background=True)
        for _ in range(3):
            tiny(torch.randint(0, 1000, (1, 8)))
        torchnative.wait_for_compiles()
        alone = []
        for _ in range(50):
            t = time.perf_counter()
            ttt(x)
            alone.append(time.perf_counter() - t)
        model = models.build("gpt2", size)
        model.config.use_cache = False
        torchnative.accelerate(model, delegates=["ort"], compile_after=2, background=True)
        ids = torch.randint(0, 1000, (1, 16))
        model(ids)
        model(ids)  # starts the compile
        started, during = time.perf_counter(), []
        while len(during) < 5 or not all(job.done() for job, *_ in CACHE.building.values()):
            t = time.perf_counter()
            ttt(x)
            during.append(time.perf_counter() - t)
        compile_s = time.perf_counter() - started
    return {"alone_ms": statistics.median(alone) * 1e3, "compile_s": compile_s, "calls": len(during),
            "median_ms": statistics.median(during) * 1e3, "mean_ms": statistics.mean(during) * 1e3,
            "worst_ms": max(during) * 1e3}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--model", default="base", help="GPT-2 preset whose graph compiles (tiny, base)")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.one:
        print(json.dumps(one(a.model)))
        return
    rows = []
    for r in range(a.rounds):
        for mode, flag in MODES.items():
            env = {**os.environ, "TORCHNATIVE_COMPILE_PROCESS": flag, "TORCHNATIVE_CACHE_DIR": "off"}
            out = subprocess.run([sys.executable, __file__, "--one", "--model", a.model], env=env,
                                 capture_output=True, text=True, check=True)
            row = {"mode": mode, "round": r, **json.loads(out.stdout.strip().splitlines()[-1])}
            row["mean_x"] = row["mean_ms"] / row["alone_ms"]
            row["worst_x"] = row["worst_ms"] / row["alone_ms"]
            rows.append(row)
            time.sleep(2)
    print("mean_x / worst_x: a call during the compile as a multiple of the same call alone (lower is better)")
    print(table(rows, [("mode", "{}"), ("round", "{}"), ("alone_ms", "{:.1f}"), ("compile_s", "{:.1f}"),
                       ("calls", "{}"), ("median_ms", "{:.1f}"), ("mean_ms", "{:.1f}"), ("worst_ms", "{:.0f}"),
                       ("mean_x", "{:.2f}x"), ("worst_x", "{:.1f}x")]))
    print(write("compile_beside", {"rows": rows}))


if __name__ == "__main__":
    main()

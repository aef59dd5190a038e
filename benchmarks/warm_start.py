"""Warm start: a second process running `accelerate` on BERT-base (seq 128) with the disk cache
populated by the first, vs a cold process with an empty cache.

    python benchmarks/warm_start.py [--delegates ort] [--rounds 2]

Each round runs a cold process (fresh cache directory) then a warm one (the same directory).
Measured inside each process, from after the model is built: `first_accelerated_s` = accelerate
with compile_after=1 and the first call (capture, partitioning, compile or cache load, run);
`default_first_s` / `default_second_s` = with the default compile_after=2 the first call (on
eager) and the second (the first on the delegates). Also the process's wall time. Medians over
rounds. Writes benchmarks/results/warm_start.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from common import table, write  # noqa: E402

CHILD = """
import json, sys, time, torch, torchnative
from torchnative import models
delegates, compile_after = sys.argv[1].split(","), int(sys.argv[2])
model = models.build("bert", "base")
inputs = models.example_inputs("bert", model, seq=128)
with torch.no_grad():
    expected = model(**inputs).last_hidden_state
    t = time.perf_counter()
    torchnative.accelerate(model, delegates=delegates, compile_after=compile_after)
    times = []
    for _ in range(compile_after):
        out = model(**inputs).last_hidden_state
        times.append(time.perf_counter() - t)
torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
print(json.dumps({"times": times, "disk_cache": torchnative.stats()["disk_cache"]}))
"""


def child(cache: str, delegates: str, compile_after: int) -> dict:
    env = {**os.environ, "TORCHNATIVE_CACHE_DIR": cache}
    started = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", CHILD, delegates, str(compile_after)], env=env,
                          capture_output=True, text=True, check=False)
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    result = json.loads(done.stdout.strip().splitlines()[-1])
    result["wall_s"] = time.perf_counter() - started
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--delegates", default="ort")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    samples: dict[str, dict[str, list]] = {"cold": {}, "warm": {}}
    for _ in range(args.rounds):
        with tempfile.TemporaryDirectory() as a, tempfile.TemporaryDirectory() as b:
            for cache, compile_after, key in ((a, 1, "first_accelerated_s"), (b, 2, "default_second_s")):
                for phase in ("cold", "warm"):
                    r = child(cache, args.delegates, compile_after)
                    s = samples[phase]
                    s.setdefault(key, []).append(r["times"][-1])
                    if compile_after == 2:
                        s.setdefault("default_first_s", []).append(r["times"][0])
                    s.setdefault(f"wall_s_compile_after_{compile_after}", []).append(r["wall_s"])
                    s.setdefault("disk_cache", []).append(r["disk_cache"])
                    time.sleep(1)
    rows = []
    for phase, s in samples.items():
        row = {"start": phase, **{k: statistics.median(v) for k, v in s.items() if k != "disk_cache"}}
        row["disk_cache"] = json.dumps(s["disk_cache"][-1])
        rows.append(row)
    cold, warm = rows
    rows.append({"start": "warm / cold", **{k: warm[k] / cold[k] for k in cold if isinstance(cold[k], float)}})
    cols = [("start", "{}"), ("first_accelerated_s", "{:.2f}"), ("default_first_s", "{:.2f}"),
            ("default_second_s", "{:.2f}"), ("wall_s_compile_after_1", "{:.2f}"), ("disk_cache", "{}")]
    print(f"BERT-base seq 128, delegates {args.delegates}, medians of {args.rounds} round(s); seconds from "
          f"after the model is built (wall: the whole process, imports and model construction included)")
    print(table(rows, cols))
    print(f"written to {write('warm_start', {'delegates': args.delegates, 'rounds': args.rounds, 'rows': rows})}")


if __name__ == "__main__":
    main()

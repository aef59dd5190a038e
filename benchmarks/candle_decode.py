"""GPT-2 small greedy decoding on the candle delegate: tokens/s of eager float32 against
torchnative.accelerate with `candle` (float32), `candle-q8_0` and `candle-q4k`, and how many of the
greedy tokens each shares with eager float32.

    python benchmarks/candle_decode.py [--steps 32] [--prompt 16] [--runs 3]

GPT2LMHeadModel(GPT2Config()) with random weights (torch.manual_seed(0)), nothing downloaded; a
static KV cache. Each call prefills the prompt again and decodes `steps` tokens; tokens/s counts the
decode steps only. Engines run interleaved with idle gaps (common.interleave). Under accelerate a
decode step is replayed (its programs run without forward's Python); the table also times one step's
compiled program alone (all its partitions, eager ones included) and its candle
partitions alone, on the inputs a captured step gave them. Prints a table; writes
benchmarks/results/candle_decode.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

from torchnative import models
from torchnative.cache import program_cache

sys.path.insert(0, str(Path(__file__).parent))
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")
VARIANTS = ["candle", "candle-q8_0", "candle-q4k"]


class Decoder:
    """Greedy decoding of `steps` tokens after a prefill of `prompt`, on a static cache. Each call
    starts over (transformers' StaticCache keeps its own write position) and records how long its
    decode steps took."""

    def __init__(self, model, prompt: torch.Tensor, steps: int, cache_len: int | None = None):
        from transformers import StaticCache

        self.model, self.prompt, self.steps = model, prompt, steps
        self.cache = StaticCache(config=model.config, max_cache_len=cache_len or prompt.shape[1] + steps)
        self.decode_s: list[float] = []

    def prefill(self) -> torch.Tensor:
        self.cache.reset()
        positions = torch.arange(self.prompt.shape[1])
        logits = self.model(self.prompt, past_key_values=self.cache, cache_position=positions).logits
        return logits[:, -1:].argmax(-1)

    def step(self, token: torch.Tensor, i: int) -> torch.Tensor:
        position = torch.tensor([self.prompt.shape[1] + i])
        return self.model(token, past_key_values=self.cache, cache_position=position).logits[:, -1:].argmax(-1)

    def __call__(self) -> list[int]:
        with torch.no_grad():
            token, tokens = self.prefill(), []
            t = time.perf_counter()
            for i in range(self.steps):
                token = self.step(token, i)
                tokens.append(int(token))
            self.decode_s.append(time.perf_counter() - t)
        return tokens


def _last_step_inputs(decoder: Decoder, delegate: str) -> tuple:
    """The compiled program of a decode step and what it and each of its partitions were given
    (by id), seen by running one step with spies on them. Reads the runtime's program cache: a
    benchmark's window into it, nothing more."""
    programs = [p for p in program_cache.programs()
                if any(s.delegate == delegate for s in p.steps or ())]
    seen: dict = {}
    spied = [(p, "run_fn") for p in programs] + [(s, "run") for p in programs for s in p.steps]
    originals = [getattr(o, attr) for o, attr in spied]
    for (o, attr), run in zip(spied, originals):
        setattr(o, attr, lambda x, o=o, run=run: (seen.__setitem__(id(o), x), run(x))[1])
    with torch.no_grad():
        decoder.step(decoder.prefill(), 0)
    for (o, attr), run in zip(spied, originals):
        setattr(o, attr, run)
    program = next(p for p in programs if id(p) in seen)
    return program, seen


def _median_ms(fn, runs: int = 15) -> float:
    fn()
    return statistics.median(elapsed(fn) for _ in range(runs)) * 1e3


def _alone(decoder: Decoder, delegate: str) -> dict:
    """One decode step's compiled program, and its `delegate` partitions, timed on their own."""
    program, seen = _last_step_inputs(decoder, delegate)
    steps = [s for s in program.steps if s.delegate == delegate]
    given = seen[id(program)][:len(seen[id(program)]) - len(program.extra)]  # its run_fn was also given the constants a pass made
    # in one pass, in order, as in a step: one partition run again and again would find its
    # weights in the 32 MiB L3 cache, a step streams all of them from memory
    return {"ops_per_step": len(program.graph.op_nodes()),
            "partitions": f"{len(steps)} {delegate} + {len(program.steps) - len(steps)} eager",
            "program_ms": _median_ms(lambda: program(given)),
            "delegate_ms": _median_ms(lambda: [s.run(seen[id(s)]) for s in steps])}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    a = p.parse_args()
    model = models.build("gpt2", "base")  # GPT2Config() defaults, torch.manual_seed(0), random weights
    prompt = models.example_inputs("gpt2", model, seq=a.prompt)["input_ids"]
    decoders = {"eager": Decoder(model, prompt, a.steps)}
    rows = {"eager": {"engine": "eager fp32"}}
    for d in VARIANTS:
        decoders[d] = Decoder(torchnative.accelerate(models.build("gpt2", "base"), delegates=[d]), prompt, a.steps)
        rows[d] = {"engine": f"accel[{d}]"}
    tokens = {}
    for k, decoder in decoders.items():
        rows[k]["first_s"] = elapsed(lambda: tokens.__setitem__(k, decoder()))
    torchnative.reset_stats()
    interleave(decoders, a.runs)
    fallbacks = torchnative.stats()["fallbacks"]
    # decode_s[2:]: after the first call and interleave's warm-up call
    eager_step_ms = statistics.median(decoders["eager"].decode_s[2:]) / a.steps * 1e3
    for k, r in rows.items():
        r["step_ms"] = statistics.median(decoders[k].decode_s[2:]) / a.steps * 1e3
        r["tokens_per_s"] = 1e3 / r["step_ms"]
        r["x_eager"] = eager_step_ms / r["step_ms"]
        same = [x == y for x, y in zip(tokens[k], tokens["eager"])]
        r["same_tokens"] = f"{sum(same)}/{a.steps}"
        r["first_divergence"] = same.index(False) if not all(same) else None
        if k != "eager":
            r.update(_alone(decoders[k], k))
            r["outside_ms"] = r["step_ms"] - r["program_ms"]
            r["program_x"] = eager_step_ms / r["program_ms"]
            r["delegate_x"] = eager_step_ms / r["delegate_ms"]
            r["fallbacks"] = sum(n for why, n in fallbacks.items() if why.startswith(f"{k}:"))
    cols = [("engine", "{}"), ("tokens_per_s", "{:.1f}"), ("step_ms", "{:.1f}"), ("x_eager", "{:.2f}x"),
            ("outside_ms", "{:.1f}"), ("program_ms", "{:.1f}"), ("program_x", "{:.2f}x"), ("delegate_ms", "{:.1f}"),
            ("delegate_x", "{:.2f}x"), ("same_tokens", "{}"), ("first_divergence", "{}"), ("partitions", "{}"),
            ("fallbacks", "{}"), ("first_s", "{:.1f}")]
    print(f"GPT-2 small (random weights), greedy decoding of {a.steps} tokens after a {a.prompt}-token prompt, "
          f"{rows['candle']['ops_per_step']} ops per decode step; medians of {a.runs} interleaved runs")
    print(table(list(rows.values()), cols))
    print("step_ms: one decode step end to end; outside_ms: step_ms - program_ms, the replay's guards and glue "
          "(a difference of two medians: it can be below 0); program_ms: the step's compiled program alone; "
          "delegate_ms: its candle partitions alone, in one pass, transfers included; *_x: eager's step_ms over "
          "that; first_s: first call (compiles)")
    payload = {"torch": torch.__version__, "steps": a.steps, "prompt": a.prompt, "rows": list(rows.values()),
               "tokens": tokens}
    print(f"wrote {write('candle_decode', payload)}")


if __name__ == "__main__":
    main()

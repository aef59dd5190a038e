"""Real traffic (issue 37): what users send, not what our other benchmarks repeat. Every call a new
size, engines interleaved call by call (each its own model copy), idle gaps between.

    python benchmarks/traffic.py [--workloads chat-gpt2,chat-llama,bert,batches,scoring,ttt,memory,memory-chat] [--calls 16]
                                 [--new 24] [--no-compile]

- chat-*: `generate(max_new_tokens=--new)` with the default cache, each call a new prompt length
  in 8..200 (GPT-2 small; a Llama-style model of hidden 768, 4 layers, grouped KV heads).
- bert: BERT-base at 20 random lengths in 8..384.
- batches: GPT-2 small's forward (no cache: scoring, as a reranker or a perplexity job calls it)
  at a random batch size in 1..4 and length in 8..128 each call, 3 x --calls calls.
- scoring: GPT-2 small's `model(ids).logits` with the default config (its forward makes a
  DynamicCache for its output) at a random length in 8..256 each call, 3 x --calls calls.
- ttt: a TTT-Linear-style layer stack (a fast weight updated by a gradient step per chunk of 16
  tokens, inside forward; a data read per chunk; outputs written into a buffer made before the
  scan; a cache object carrying the fast weights across calls, written with copy_; inputs sliced
  from one long sequence): forward of whole sequences, then streaming chunks.
- memory: 2 x 1000 calls of random sizes of a tiny GPT-2 forward; resident memory growth in each
  thousand (the first holds the first compiles).
- memory-chat: 2 x 8 `generate()` calls of GPT-2 small at random prompt lengths; resident memory
  growth in each eight (not in the default list: a minute of recording at new sizes).

Per workload and engine: the first call's seconds, calls 5+, all calls and the last quarter of the
calls (the steady state) as a ratio to eager's (> 1 is faster; for calls 5+ also the median of the
per-call ratios), whether outputs equal eager's. Prints tables; writes benchmarks/results/traffic.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import copy
import gc
import os
import random
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

from torchnative import models
from torchnative.cache.program_cache import clear_caches, programs

sys.path.insert(0, str(Path(__file__).parent))
from common import GAP_S, elapsed, table, write  # noqa: E402

warnings.filterwarnings("ignore")


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
                         intermediate_size=2048, vocab_size=32000, use_cache=True)
    return LlamaForCausalLM(config).eval()


def _engines(model: torch.nn.Module, compile_: bool) -> dict[str, torch.nn.Module]:
    engines = {"eager": model, "accelerate": torchnative.accelerate(copy.deepcopy(model))}
    if compile_:
        compiled = copy.deepcopy(model)
        compiled.forward = torch.compile(compiled.forward)  # torch.compile's dynamic default
        engines["torch.compile"] = compiled
    return engines


def _interleaved(engines: dict, calls: list[Callable[[Any], Any]]) -> tuple[dict, dict]:
    """Each call on every engine in turn (the order turning each call), idle gaps between:
    seconds per engine per call, and whether each engine's outputs equalled eager's."""
    seconds = {k: [] for k in engines}
    same = {k: True for k in engines}
    names = list(engines)
    for i, call in enumerate(calls):
        out = {}
        for k in names[i % len(names):] + names[:i % len(names)]:
            def run(k=k):
                with torch.no_grad():
                    out[k] = call(engines[k])
            seconds[k].append(elapsed(run))
            time.sleep(GAP_S)
        for k in engines:
            same[k] &= _equal(out[k], out["eager"])
        print(f"    call {i}: " + ", ".join(f"{k} {seconds[k][-1]:.2f} s" for k in names), flush=True)
    return seconds, same


def _equal(a: Any, b: Any) -> bool:
    if a.dtype in (torch.int64, torch.int32):
        return torch.equal(a, b)
    return torch.allclose(a, b, rtol=1e-3, atol=1e-4)


def _row(workload: str, seconds: dict, same: dict) -> dict:
    row = {"workload": workload, "calls": len(seconds["eager"]), "eager first s": seconds["eager"][0],
           "eager 5+ s": sum(seconds["eager"][4:])}
    for k in seconds:
        if k == "eager":
            continue
        row[f"{k} first x"] = seconds[k][0] / seconds["eager"][0]  # the first call's time, as a multiple of eager's
        row[f"{k} 5+ x"] = sum(seconds["eager"][4:]) / sum(seconds[k][4:])
        row[f"{k} all x"] = sum(seconds["eager"]) / sum(seconds[k])
        # the steady state: the last quarter of the calls (a compile that repays has landed)
        quarter = max(len(seconds[k]) // 4, 1)
        row[f"{k} last quarter x"] = sum(seconds["eager"][-quarter:]) / sum(seconds[k][-quarter:])
        # per call, eager's time over the engine's, the median of calls 5+: a call of a few ms timed
        # once is at the mercy of a scheduler tick, which the sum above is not spared
        row[f"{k} 5+ median x"] = statistics.median(e / s for e, s in zip(seconds["eager"][4:], seconds[k][4:]))
        row[f"{k} worst x"] = max(s / e for s, e in zip(seconds[k], seconds["eager"]))
        row[f"{k} same"] = same[k]
    return row


def chat(name: str, calls: int, new: int, compile_: bool) -> dict:
    clear_caches()
    torchnative.reset_stats()
    model = models.build("gpt2", "base") if name == "gpt2" else _llama()
    engines = _engines(model, compile_)
    rng = random.Random(0)
    lengths = rng.sample(range(8, 201), calls)
    # token 0 is the pad token: a prompt holding it gets an attention mask with holes (generate()
    # masks pad tokens), another workload (a padded batch's) than a chat prompt
    prompts = [torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n)) for n in lengths]
    kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
    print(f"  chat-{name}: prompt lengths {lengths}", flush=True)
    seconds, same = _interleaved(engines, [lambda m, p=p: m.generate(p, **kwargs) for p in prompts])
    return {**_row(f"chat-{name}", seconds, same), "stats": _stats()}


def bert(calls: int, compile_: bool) -> dict:
    clear_caches()
    torchnative.reset_stats()
    model = models.build("bert", "base")
    engines = _engines(model, compile_)
    rng = random.Random(1)
    inputs = [models.example_inputs("bert", model, seq=n) for n in rng.sample(range(8, 385), calls)]
    seconds, same = _interleaved(engines, [lambda m, i=i: m(**i).last_hidden_state for i in inputs])
    return {**_row("bert", seconds, same), "stats": _stats()}


def batches(calls: int, compile_: bool) -> dict:
    clear_caches()
    torchnative.reset_stats()
    model = models.build("gpt2", "base")
    model.config.use_cache = False
    engines = _engines(model, compile_)
    rng = random.Random(3)
    inputs = [torch.randint(1, 1000, (rng.randint(1, 4), rng.randint(8, 128)), generator=torch.Generator().manual_seed(i))
              for i in range(calls)]
    seconds, same = _interleaved(engines, [lambda m, x=x: m(x).logits for x in inputs])
    return {**_row("batches", seconds, same), "stats": _stats()}


def scoring(calls: int, compile_: bool) -> dict:
    """GPT-2 small's forward as scoring code calls it, `model(ids).logits` with the default config:
    each call at a new length, and the DynamicCache use_cache makes in its output."""
    clear_caches()
    torchnative.reset_stats()
    model = models.build("gpt2", "base")
    engines = _engines(model, compile_)
    rng = random.Random(4)
    inputs = [torch.randint(1, 1000, (1, n), generator=torch.Generator().manual_seed(n)) for n in rng.sample(range(8, 257), calls)]
    seconds, same = _interleaved(engines, [lambda m, x=x: m(x).logits for x in inputs])
    return {**_row("scoring", seconds, same), "stats": _stats()}


class FastWeightCache:
    """Per layer, the fast weight carried from one call to the next (as a streaming model keeps it)."""

    def __init__(self, layers: int, dim: int):
        self.weights = [torch.zeros(dim, dim) for _ in range(layers)]

    def update(self, layer: int, weight: torch.Tensor) -> None:
        self.weights[layer].copy_(weight)


class TTTLinear(torch.nn.Module):
    """A TTT-Linear-style layer: per chunk, the fast weight W takes one gradient step on the
    reconstruction loss of the chunk's keys onto its values, then the chunk's queries read W."""

    def __init__(self, dim: int, chunk: int = 16, lr: float = 0.1):
        super().__init__()
        self.q, self.k, self.v, self.o = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.w0 = torch.nn.Parameter(torch.randn(dim, dim) / dim ** 0.5)
        self.bias = torch.nn.Parameter(torch.zeros(dim))
        self.chunk, self.lr = chunk, lr

    def forward(self, x: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, n, d = x.shape
        q, k, v = self.q(x), self.k(x), self.v(x)
        out = torch.empty(b, n, d)
        for i in range(0, n, self.chunk):
            use_bias = not torch.isnan(self.bias).any()  # a data read every chunk, as the library does
            kc, vc, qc = k[:, i:i + self.chunk], v[:, i:i + self.chunk], q[:, i:i + self.chunk]
            err = kc @ w - vc
            w = w - self.lr * (kc.transpose(1, 2) @ err).mean(0) / self.chunk
            y = qc @ w
            out[:, i:i + self.chunk] = y + self.bias if use_bias else y
        return self.o(out), w


class TTTModel(torch.nn.Module):
    def __init__(self, dim: int = 256, layers: int = 4):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(TTTLinear(dim) for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)

    def forward(self, x: torch.Tensor, cache: FastWeightCache | None = None) -> torch.Tensor:
        for j, layer in enumerate(self.layers):
            w = cache.weights[j] if cache is not None else layer.w0
            h, w = layer(self.norm(x), w)
            x = x + h
            if cache is not None:
                cache.update(j, w)
        return x


def ttt(calls: int, compile_: bool) -> dict:
    clear_caches()
    torchnative.reset_stats()
    model = TTTModel()
    engines = _engines(model, compile_)
    sequence = torch.randn(2, 64 * calls, 256, generator=torch.Generator().manual_seed(0))
    whole = [lambda m, i=i: m(sequence[:, i * 64:(i + 1) * 64]) for i in range(calls)]
    seconds, same = _interleaved(engines, whole)
    rows = [{**_row("ttt forward", seconds, same), "stats": _stats()}]
    caches = {k: FastWeightCache(len(model.layers), 256) for k in engines}
    for c in caches.values():
        for j, layer in enumerate(model.layers):
            c.weights[j].copy_(layer.w0.detach())
    streaming = [lambda m, i=i: m(sequence[:, i * 16:(i + 1) * 16], caches[_name_of(engines, m)]) for i in range(calls * 4)]
    seconds, same = _interleaved(engines, streaming)
    rows.append({**_row("ttt streaming", seconds, same), "stats": _stats()})
    return rows


def _name_of(engines: dict, m: torch.nn.Module) -> str:
    return next(k for k, v in engines.items() if v is m)


def _rss_mb() -> float:
    with open(f"/proc/{os.getpid()}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2 ** 20


def memory(calls: int) -> dict:
    """Resident memory over two runs of `calls` forwards at random sizes, eager's then
    accelerate's, after 50 warm-up calls (allocator pools). The first run holds what happens once
    (the first compiles: their libraries, programs and sessions); the second shows whether the
    process levels off."""
    rows = {}
    rng = random.Random(2)
    sizes = [(rng.randint(1, 4), rng.randint(4, 120)) for _ in range(2 * calls + 50)]
    for k in ("eager", "accelerate"):
        clear_caches()
        model = models.build("gpt2")
        model.config.use_cache = False
        if k == "accelerate":
            torchnative.accelerate(model)
        marks = []
        with torch.no_grad():
            for i, (b, n) in enumerate(sizes):
                if i in (50, 50 + calls):
                    gc.collect()
                    marks.append(_rss_mb())
                model(torch.randint(0, 1000, (b, n)))
            gc.collect()
        marks.append(_rss_mb())
        rows[k] = (marks[1] - marks[0], marks[2] - marks[1])
    return {"workload": f"memory (2 x {calls} calls)", "eager growth MB (first, second)": rows["eager"],
            "accelerate growth MB (first, second)": rows["accelerate"], "evicted": dict(torchnative.stats()["evicted"])}


def memory_chat(calls: int, new: int) -> dict:
    """Resident memory over two runs of `calls` generate() calls of GPT-2 small, each a new prompt
    length, eager's then accelerate's with compile_after 10⁹ (graphs of one size stay on eager; a
    template confirmed at a third size compiles at once: GPT-2's prefill and decode templates get an
    ONNX Runtime program each, ~750 MB resident apiece)."""
    rows = {}
    rng = random.Random(0)
    lengths = [rng.randint(8, 200) for _ in range(2 * calls + 1)]
    for k in ("eager", "accelerate"):
        clear_caches()
        model = models.build("gpt2", "base")
        if k == "accelerate":
            torchnative.accelerate(model, compile_after=10 ** 9)
        marks = []
        with torch.no_grad():
            for i, n in enumerate(lengths):
                if i in (1, 1 + calls):
                    gc.collect()
                    marks.append(_rss_mb())
                model.generate(torch.randint(1, 1000, (1, n)), max_new_tokens=new, do_sample=False, pad_token_id=0)
            gc.collect()
        marks.append(_rss_mb())
        rows[k] = (round(marks[1] - marks[0]), round(marks[2] - marks[1]))
        del model
    return {"workload": f"memory-chat (2 x {calls} generate, GPT-2 small)", "eager growth MB (first, second)": rows["eager"],
            "accelerate growth MB (first, second)": rows["accelerate"]}


def _stats() -> dict:
    s = torchnative.stats()
    return {"programs compiled": sum(1 for p in programs() if any(d != "eager" for d, _ in p.partitions)),
            "replays": s["replays"], "not compiled": dict(s["not_compiled"]), "graphs built": s["graphs_built"],
            "fallbacks": dict(s["fallbacks"])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workloads", default="chat-gpt2,chat-llama,bert,batches,scoring,ttt,memory")
    parser.add_argument("--calls", type=int, default=16)
    parser.add_argument("--new", type=int, default=24)
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    rows, extra = [], []
    for w in args.workloads.split(","):
        print(w, flush=True)
        if w.startswith("chat-"):
            rows.append(chat(w.split("-", 1)[1], args.calls, args.new, not args.no_compile))
        elif w == "bert":
            rows.append(bert(max(args.calls, 20), not args.no_compile))
        elif w == "batches":
            rows.append(batches(3 * args.calls, not args.no_compile))
        elif w == "scoring":
            rows.append(scoring(3 * args.calls, not args.no_compile))
        elif w == "ttt":
            rows += ttt(args.calls, not args.no_compile)
        elif w == "memory":
            extra.append(memory(1000))
        elif w == "memory-chat":
            extra.append(memory_chat(8, args.new))
    engines = ["accelerate"] + ([] if args.no_compile else ["torch.compile"])
    cols = [("workload", "{}"), ("calls", "{}"), ("eager first s", "{:.2f}")]
    for k in engines:
        cols += [(f"{k} first x", "{:.2f}"), (f"{k} 5+ x", "{:.2f}x"), (f"{k} 5+ median x", "{:.2f}x"), (f"{k} all x", "{:.2f}x"),
                 (f"{k} last quarter x", "{:.2f}x"), (f"{k} worst x", "{:.2f}"), (f"{k} same", "{}")]
    print("first x / worst x: a call's time as a multiple of eager's (lower is better); 5+ x / all x: eager's "
          "time over the engine's (higher is better); 5+ median x: the median of those ratios per call")
    print(table(rows, cols))
    for r in rows:
        if "stats" in r:
            print(f"{r['workload']}: {r['stats']}")
    for e in extra:
        print(e)
    print(f"wrote {write('traffic', {'rows': rows, 'memory': extra})}")


if __name__ == "__main__":
    main()

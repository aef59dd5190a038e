"""`generate()` with transformers' default cache (DynamicCache: every decode step has new sizes,
every prompt its own length), and BERT-base prefill at several lengths, against eager and
`torch.compile` in one run (issue 25: sizes that vary become symbols).

    python benchmarks/generate.py [--runs 3] [--new 64] [--models gpt2,llama] [--no-compile] [--no-bert]

GPT-2 small and a Llama-style model (hidden 768, 4 layers, grouped KV heads), random weights,
greedy `generate(max_new_tokens=64)` from prompts of 7, 32 and 100 tokens, one model object per
engine; accelerate with its default delegates. Per prompt: whether each engine's tokens equal
eager's, its first call's time (recording and compiles included), and its steady tokens/s (the
median over rounds, engines interleaved with idle gaps: common.interleave). Per model: the
programs compiled for a delegate over all prompts, and the graphs made to stand for every size.
BERT-base: each length's first call (in turn: the third confirms what the first two fitted),
then each length's steady time, and the programs compiled over all five.
Prints tables; writes benchmarks/results/generate.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import copy
import sys
import warnings
from pathlib import Path

import torch

from torchnative import models
from torchnative.cache.program_cache import clear_caches, programs

sys.path.insert(0, str(Path(__file__).parent))
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")
PROMPTS = (7, 32, 100)
LENGTHS = (16, 64, 128, 256, 384)


def _llama() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(hidden_size=768, num_hidden_layers=4, num_attention_heads=12, num_key_value_heads=4,
                         intermediate_size=2048, vocab_size=32000, use_cache=True)
    return LlamaForCausalLM(config).eval()


def _model(name: str) -> torch.nn.Module:
    return models.build("gpt2", "base") if name == "gpt2" else _llama()


def _compiled_programs() -> int:
    return sum(1 for p in programs() if any(d != "eager" for d, _ in p.partitions))


def _engines(name: str, compile_: bool) -> dict[str, torch.nn.Module]:
    eager = _model(name)
    engines = {"eager": eager, "accelerate": torchnative.accelerate(copy.deepcopy(eager))}
    if compile_:
        compiled = copy.deepcopy(eager)
        compiled.forward = torch.compile(compiled.forward)  # generate() calls forward: torch.compile's dynamic default
        engines["torch.compile"] = compiled
    return engines


def bench_generate(name: str, runs: int, new: int, compile_: bool) -> tuple[list[dict], dict]:
    clear_caches()
    torchnative.reset_stats()
    engines = _engines(name, compile_)
    calls, rows = {}, []
    for length in PROMPTS:
        ids = torch.randint(0, 1000, (1, length), generator=torch.Generator().manual_seed(length))
        kwargs = dict(max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=0)
        out: dict = {}
        row = {"model": name, "prompt": length}
        for k, m in engines.items():
            def call(m=m, ids=ids, k=k):
                with torch.no_grad():
                    out[k] = m.generate(ids, **kwargs)
            row[f"{k} first s"] = elapsed(call)
            calls[k, length] = call
        for k in engines:
            row[f"{k} same"] = torch.equal(out[k], out["eager"])
        rows.append(row)
        print(f"  {name} prompt {length}: first calls " + ", ".join(f"{k} {row[f'{k} first s']:.1f} s" for k in engines),
              flush=True)
    for row in rows:
        steady = interleave({k: calls[k, row["prompt"]] for k in engines}, runs)
        for k, s in steady.items():
            row[f"{k} tok/s"] = new / s
        for k in engines:
            if k != "eager":
                row[f"{k} x"] = steady["eager"] / steady[k]
    stats = torchnative.stats()
    summary = {"model": name, "compiled programs": _compiled_programs(), "symbolic graphs": stats["symbolic_graphs"],
               "replays": stats["replays"], "not compiled": dict(stats["not_compiled"]), "fallbacks": dict(stats["fallbacks"])}
    return rows, summary


def bench_bert(runs: int) -> tuple[list[dict], dict]:
    """Each length's first call in turn (the third confirms the templates the first two fitted),
    then each length's steady time."""
    clear_caches()
    torchnative.reset_stats()
    eager = models.build("bert", "base")
    accel = torchnative.accelerate(copy.deepcopy(eager))
    got: dict = {}

    def run(m, k, inputs):
        with torch.no_grad():
            got[k] = m(**inputs).last_hidden_state
    rows = []
    for length in LENGTHS:
        inputs = models.example_inputs("bert", eager, seq=length)
        rows.append({"length": length, "accelerate first s": elapsed(lambda: run(accel, "accelerate", inputs))})
    for row in rows:
        inputs = models.example_inputs("bert", eager, seq=row["length"])
        steady = interleave({"eager": lambda: run(eager, "eager", inputs),
                             "accelerate": lambda: run(accel, "accelerate", inputs)}, runs)
        row.update({"eager ms": steady["eager"] * 1e3, "accelerate ms": steady["accelerate"] * 1e3,
                    "x": steady["eager"] / steady["accelerate"],
                    "max abs err": (got["accelerate"] - got["eager"]).abs().max().item()})
        print(f"  bert {row['length']}: first {row['accelerate first s']:.1f} s, {row['x']:.2f}x eager", flush=True)
    stats = torchnative.stats()
    return rows, {"compiled programs": _compiled_programs(), "symbolic graphs": stats["symbolic_graphs"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--new", type=int, default=64)
    parser.add_argument("--models", default="gpt2,llama")
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--no-bert", action="store_true")
    args = parser.parse_args()
    results: dict = {"generate": [], "summaries": [], "bert": None}
    for name in args.models.split(","):
        rows, summary = bench_generate(name, args.runs, args.new, not args.no_compile)
        results["generate"] += rows
        results["summaries"].append(summary)
    engines = ["accelerate"] + ([] if args.no_compile else ["torch.compile"])
    cols = [("model", "{}"), ("prompt", "{}"), ("eager tok/s", "{:.1f}")]
    for k in engines:
        cols += [(f"{k} tok/s", "{:.1f}"), (f"{k} x", "{:.2f}x"), (f"{k} same", "{}"), (f"{k} first s", "{:.1f}")]
    print(table(results["generate"], cols))
    for s in results["summaries"]:
        print(f"{s['model']}: {s['compiled programs']} programs compiled for a delegate over {len(PROMPTS)} prompts, "
              f"{s['symbolic graphs']} graphs for every size, {s['replays']} calls replayed; "
              f"not compiled {s['not compiled'] or 'none'}, fallbacks {s['fallbacks'] or 'none'}")
    if not args.no_bert:
        rows, summary = bench_bert(args.runs)
        results["bert"] = {"rows": rows, **summary}
        print(table(rows, [("length", "{}"), ("eager ms", "{:.1f}"), ("accelerate ms", "{:.1f}"), ("x", "{:.2f}x"),
                           ("accelerate first s", "{:.1f}"), ("max abs err", "{:.1e}")]))
        print(f"bert-base: {summary['compiled programs']} programs compiled for a delegate over {len(LENGTHS)} lengths, "
              f"{summary['symbolic graphs']} graphs for every size")
    print(f"wrote {write('generate', results)}")


if __name__ == "__main__":
    main()

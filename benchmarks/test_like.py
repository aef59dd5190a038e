"""A test suite's use of a model (issue 45): every test builds a new model from a tiny config and
calls it a few times, each at new shapes — batches of new sizes, left-padded prompts, hidden states
returned, greedy and beam-search generate. Plain eager vs `accelerate` (applied right after the
model is built, as a pytest plugin at the end of `post_init` would) vs `torch.compile` on the
forward, tests interleaved engine by engine, idle gaps between; outputs checked against eager's.

    python benchmarks/test_like.py [--tests 6] [--models gpt2,llama,bert,t5] [--no-compile]

Per model: the whole sequence's seconds per engine, its ratio to eager's (> 1 is faster), the
worst single test's ratio, and whether every output equalled eager's.
Prints a table; writes benchmarks/results/test_like.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import sys
import time
import warnings
from pathlib import Path

import torch

from torchnative import models
from torchnative.cache.program_cache import clear_caches

sys.path.insert(0, str(Path(__file__).parent))
from common import GAP_S, elapsed, table, write  # noqa: E402

warnings.filterwarnings("ignore")
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "bert": "BertModel",
                 "t5": "T5ForConditionalGeneration"}


def _padded(batch: int, seq: int, pad: int, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    ids[0, :pad], mask[0, :pad] = 0, 0
    return {"input_ids": ids, "attention_mask": mask}


def _calls(name: str, test: int) -> list[tuple[str, dict]]:
    """One test's calls: ("forward" or "generate", kwargs), shapes new to each test."""
    batch, seq = 1 + test % 3, 5 + 3 * test
    calls = [("forward", _padded(batch, seq, 0, test)),
             ("forward", {**_padded(batch + 1, seq + 2, 2, test + 100), "output_hidden_states": True})]
    if name != "bert":
        calls += [("generate", {**_padded(2, seq, 3, test + 200), "max_new_tokens": 5, "do_sample": False}),
                  ("generate", {**_padded(1, seq + 1, 0, test + 300), "max_new_tokens": 5, "num_beams": 2})]
    if name == "t5":
        calls = [(k, {**c, "decoder_input_ids": c["input_ids"][:, :3]} if k == "forward" else c) for k, c in calls]
    return calls


def _build(name: str, test: int) -> torch.nn.Module:
    model = models.transformers_model(ARCHITECTURES[name], seed=test, use_cache=True)
    if hasattr(model, "generation_config"):
        model.generation_config.pad_token_id = 0
    return model


def _run(model: torch.nn.Module, calls: list) -> list:
    out = []
    with torch.no_grad():
        for kind, kwargs in calls:
            if kind == "generate":
                out.append(model.generate(**kwargs))
            else:
                r = model(**kwargs)
                out.append(r.logits if "logits" in r else r.last_hidden_state)
    return out


def _same(a: list, b: list) -> bool:
    return all(x.shape == y.shape and (torch.equal(x, y) if not x.is_floating_point()
                                       else torch.allclose(x, y, rtol=1e-4, atol=1e-5)) for x, y in zip(a, b))


ENGINES = {
    "eager": lambda m: m,
    "accelerate": lambda m: torchnative.accelerate(m),
    "torch.compile": lambda m: (setattr(m, "forward", torch.compile(m.forward)), m)[1],
}


def bench(name: str, tests: int, engines: list[str]) -> dict:
    clear_caches()
    torchnative.reset_stats()
    torch._dynamo.reset()
    seconds = {k: [] for k in engines}
    same = {k: True for k in engines}
    for test in range(tests):
        calls = _calls(name, test)
        outs = {}
        for k in engines[test % len(engines):] + engines[:test % len(engines)]:
            def one(k=k):
                outs[k] = _run(ENGINES[k](_build(name, test)), calls)  # the model's build is part of a test
            seconds[k].append(elapsed(one))
            time.sleep(GAP_S)
        for k in engines:
            same[k] &= _same(outs[k], outs["eager"])
    row = {"model": name, "tests": tests}
    for k in engines:
        row[f"{k} s"] = sum(seconds[k])
        row[f"{k} x"] = sum(seconds["eager"]) / sum(seconds[k])
        row[f"{k} worst x"] = min(e / s for e, s in zip(seconds["eager"], seconds[k]))
        row[f"{k} same"] = same[k]
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tests", type=int, default=6)
    parser.add_argument("--models", default="gpt2,llama,bert,t5")
    parser.add_argument("--no-compile", action="store_true")
    args = parser.parse_args()
    engines = [k for k in ENGINES if not (args.no_compile and k == "torch.compile")]
    rows = []
    for name in args.models.split(","):
        rows.append(bench(name, args.tests, engines))
        print(rows[-1], flush=True)
    cols = [("model", "{}"), ("tests", "{}")]
    for k in engines:
        cols += [(f"{k} s", "{:.2f}")] + ([(f"{k} x", "{:.2f}x"), (f"{k} worst x", "{:.2f}x"), (f"{k} same", "{}")]
                                           if k != "eager" else [])
    print(table(rows, cols))
    print(f"stats: {torchnative.stats()}")
    print(f"wrote {write('test_like', {'rows': rows})}")


if __name__ == "__main__":
    main()

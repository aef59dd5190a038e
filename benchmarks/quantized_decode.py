"""Quantized weights on ONNX Runtime's low-bit kernels: GPT-2 small greedy decoding (a static KV
cache of 128 positions, 32 new tokens) and BERT-base prefill, eager float32 against
torchnative.accelerate with `ort` in float32, `quantize="int8"` (MatMulInteger on dynamically
quantized activations) and `quantize="int4"` (MatMulNBits, blocks of 32), and candle's q4k.

    python benchmarks/quantized_decode.py [--steps 32] [--prompt 16] [--runs 3] [--bert-seq 128]

Random weights (torch.manual_seed(0)), nothing downloaded. Accuracy per scheme: one decode step's
logits against eager float32 and against the eager model with the weights the scheme dequantizes
to (passes.quantize.dequantized: what every delegate without low-bit kernels computes), max and
mean absolute error, and greedy tokens shared with each over the decode. Engines interleaved with
idle gaps (common.interleave). Prints tables; writes benchmarks/results/quantized_decode.json.
"""
from __future__ import annotations

import argparse
import copy
import statistics
import sys
import warnings
from pathlib import Path

import torch

import torchnative
from torchnative import models
from torchnative.passes.quantize import dequantized

sys.path.insert(0, str(Path(__file__).parent))
from candle_decode import Decoder  # noqa: E402
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")
CACHE = 128
# (row name, delegate, quantize)
ENGINES = [("accel[ort] fp32", "ort", None), ("accel[ort] int8", "ort", "int8"), ("accel[ort] int4", "ort", "int4"),
           ("accel[candle-q4k]", "candle-q4k", None)]


def reference(model: torch.nn.Module, scheme: str) -> torch.nn.Module:
    """The model with each weight a matmul reads replaced by its dequantized values: a Linear's
    (out, in), a transformers Conv1D's (in, out), and an embedding tied to the LM head."""
    from transformers.pytorch_utils import Conv1D

    ref = copy.deepcopy(model)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, (torch.nn.Linear, Conv1D)):
                # a Parameter of its own: the LM head's, tied to the embedding, is dequantized alone
                m.weight = torch.nn.Parameter(dequantized(m.weight, scheme, in_out=isinstance(m, Conv1D)))
    return ref


def _logits(model, prompt: torch.Tensor) -> torch.Tensor:
    """A decode step's logits: the step after the prompt's prefill, on a fresh static cache."""
    d = Decoder(model, prompt, 1, CACHE)
    with torch.no_grad():
        token = d.prefill()
        return d.model(token, past_key_values=d.cache, cache_position=torch.tensor([prompt.shape[1]])).logits[0, -1]


def _same(a: list[int], b: list[int]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def decode(a) -> list[dict]:
    model = models.build("gpt2", "base")
    prompt = models.example_inputs("gpt2", model, seq=a.prompt)["input_ids"]
    decoders = {"eager fp32": Decoder(model, prompt, a.steps, CACHE)}
    for name, delegate, scheme in ENGINES:
        accelerated = torchnative.accelerate(models.build("gpt2", "base"), delegates=[delegate], quantize=scheme)
        decoders[name] = Decoder(accelerated, prompt, a.steps, CACHE)
    rows = {k: {"engine": k} for k in decoders}
    tokens = {}
    for k, d in decoders.items():
        rows[k]["first_s"] = elapsed(lambda: tokens.__setitem__(k, d()))
    interleave(decoders, a.runs)
    eager_ms = statistics.median(decoders["eager fp32"].decode_s[2:]) / a.steps * 1e3
    exact = _logits(model, prompt)
    for (k, d), (_, _, scheme) in zip(decoders.items(), [(None, None, None)] + ENGINES):
        r = rows[k]
        r["step_ms"] = statistics.median(d.decode_s[2:]) / a.steps * 1e3
        r["tokens_per_s"], r["x_eager"] = 1e3 / r["step_ms"], eager_ms / r["step_ms"]
        r["same_tokens_fp32"] = _same(tokens[k], tokens["eager fp32"])
        if k == "eager fp32":
            continue
        got = _logits(d.model, prompt)
        r["max_err_fp32"], r["mean_err_fp32"] = (got - exact).abs().max().item(), (got - exact).abs().mean().item()
        kind = scheme or ("q4k" if "q4k" in k else None)
        if kind:
            ref = reference(model, kind)
            want = _logits(ref, prompt)
            r["max_err_deq"], r["mean_err_deq"] = (got - want).abs().max().item(), (got - want).abs().mean().item()
            r["same_tokens_deq"] = _same(tokens[k], Decoder(ref, prompt, a.steps, CACHE)())
    print(f"GPT-2 small (random weights), greedy decoding of {a.steps} tokens after a {a.prompt}-token prompt, "
          f"static cache of {CACHE}; medians of {a.runs} interleaved runs; logits of one decode step "
          f"(max |logit| {exact.abs().max().item():.2f})")
    cols = [("engine", "{}"), ("tokens_per_s", "{:.1f}"), ("step_ms", "{:.1f}"), ("x_eager", "{:.2f}x"),
            ("max_err_fp32", "{:.3g}"), ("mean_err_fp32", "{:.3g}"), ("max_err_deq", "{:.3g}"), ("mean_err_deq", "{:.3g}"),
            ("same_tokens_fp32", "{}"), ("same_tokens_deq", "{}"), ("first_s", "{:.1f}")]
    print(table(list(rows.values()), cols))
    return list(rows.values())


def prefill(a) -> list[dict]:
    model = models.build("bert", "base")
    inputs = models.example_inputs("bert", model, seq=a.bert_seq)
    engines = {"eager fp32": model}
    for name, delegate, scheme in ENGINES[:3]:
        engines[name] = torchnative.accelerate(models.build("bert", "base"), delegates=[delegate], quantize=scheme)

    def call(m):
        with torch.no_grad():
            return m(**inputs).last_hidden_state

    outputs = {k: call(m) for k, m in engines.items()}
    times = interleave({k: (lambda m=m: call(m)) for k, m in engines.items()}, a.runs, inner=3)
    rows = []
    for k, m in engines.items():
        out = call(m)
        rows.append({"engine": k, "ms": times[k] * 1e3, "x_eager": times["eager fp32"] / times[k],
                     "x_accel_fp32": times["accel[ort] fp32"] / times[k],
                     "max_err_fp32": (out - outputs["eager fp32"]).abs().max().item()})
    print(f"BERT-base (random weights) prefill of {a.bert_seq} tokens, batch 1; medians of {a.runs} interleaved rounds")
    print(table(rows, [("engine", "{}"), ("ms", "{:.1f}"), ("x_eager", "{:.2f}x"), ("x_accel_fp32", "{:.2f}x"),
                       ("max_err_fp32", "{:.3g}")]))
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompt", type=int, default=16)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--bert-seq", type=int, default=128)
    p.add_argument("--only", choices=["decode", "prefill"])
    a = p.parse_args()
    payload = {"torch": torch.__version__, "steps": a.steps, "prompt": a.prompt, "cache": CACHE}
    if a.only != "prefill":
        payload["decode"] = decode(a)
    if a.only != "decode":
        payload["prefill"] = prefill(a)
    print(f"wrote {write('quantized_decode', payload)}")


if __name__ == "__main__":
    main()

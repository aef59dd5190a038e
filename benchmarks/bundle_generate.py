"""Generating bundles: greedy decoding of GPT-2 small, or a Gemma-3-style model (`--model gemma3`:
Gemma 3 270M's shapes, five sliding-window layers of 32 positions to a global one, so the rings
wrap), with a static KV cache of 128 positions, a 16-token prompt and 32 new tokens, from a
`capture-and-compile` bundle (`Bundle.generate`, no transformers code)
in float32, int8 and int4 on ONNX Runtime, against the eager model with a static cache,
`torch.compile` of it, and ExecuTorch: transformers' export recipe for ExecuTorch
(`TorchExportableModuleForDecoderOnlyLM`: the cache as mutable buffers) lowered to XNNPACK and run
by ExecuTorch's runtime, fed the prompt token by token as its runner does.

    python benchmarks/bundle_generate.py [--model gpt2|gemma3] [--runs 5] [--steps 32] [--no-compile] [--no-executorch]

Random weights (seed 0), nothing downloaded. Decode time is per decode call (the prompt's prefill
excluded), the median over rounds; engines interleaved with idle gaps (common.interleave). Prints
a table; writes benchmarks/results/bundle_generate[_gemma3].json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from torchnative import models
from torchnative.bundle.build import compile_generation
from torchnative.bundle.save import save

sys.path.insert(0, str(Path(__file__).parent))
from candle_decode import Decoder  # noqa: E402
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")
CACHE, PROMPT = 128, 16


class BundleDecoder:
    """`bundle.generate` of `steps` tokens; records the time per decode call after the first token."""

    def __init__(self, bundle, prompt: torch.Tensor, steps: int):
        self.bundle, self.prompt, self.steps = bundle, prompt, steps
        self.decode_s: list[float] = []

    def __call__(self) -> list[int]:
        times: list[float] = []
        out = self.bundle.generate(self.prompt, max_new_tokens=self.steps + 1, eos=[],
                                   on_token=lambda t: times.append(time.perf_counter()))
        self.decode_s.append((times[-1] - times[0]) / (len(times) - 1) * self.steps)
        return out[0, self.prompt.shape[1] + 1:].tolist()


class ExecuTorchDecoder:
    """transformers' ExecuTorch export of the model (static cache as mutable buffers), lowered to
    XNNPACK, run by ExecuTorch's runtime: the prompt one token at a time, then greedy decoding."""

    def __init__(self, model, prompt: torch.Tensor, steps: int):
        from executorch.backends.xnnpack.partition.xnnpack_partitioner import XnnpackPartitioner
        from executorch.exir import to_edge_transform_and_lower
        from executorch.runtime import Runtime
        from transformers.integrations.executorch import TorchExportableModuleForDecoderOnlyLM

        model.generation_config.cache_implementation = "static"
        exportable = TorchExportableModuleForDecoderOnlyLM(model, batch_size=1, max_cache_len=CACHE)
        exported = exportable.export(input_ids=torch.zeros(1, 1, dtype=torch.long), cache_position=torch.tensor([0]),
                                     strict=True)
        self.buffer = to_edge_transform_and_lower(exported, partitioner=[XnnpackPartitioner()]).to_executorch().buffer
        self.program = Runtime.get().load_program(self.buffer)
        self.prompt, self.steps = prompt, steps
        self.decode_s: list[float] = []

    def __call__(self) -> list[int]:
        method = self.program.load_method("forward")  # a new method: its cache buffers start at zeros
        for p in range(self.prompt.shape[1]):
            logits = method.execute([self.prompt[:, p:p + 1], torch.tensor([p])])[0]
        token, tokens = logits[:, -1:].argmax(-1), []
        t = time.perf_counter()
        for i in range(self.steps):
            logits = method.execute([token, torch.tensor([self.prompt.shape[1] + i])])[0]
            token = logits[:, -1:].argmax(-1)
            tokens.append(int(token))
        self.decode_s.append(time.perf_counter() - t)
        return tokens


def _bundle(model, targets: list[str], quantize: str | None, where: Path):
    started = time.perf_counter()
    path, _ = save(compile_generation(model, targets, quantize, CACHE, PROMPT), where / f"{quantize or 'fp32'}.bundle",
                   type(model).__name__)
    return torchnative.load(path), time.perf_counter() - started


def _executorch(name: str, prompt: torch.Tensor, steps: int) -> ExecuTorchDecoder | str:
    """The ExecuTorch engine, or why it could not be made."""
    try:
        return ExecuTorchDecoder(models.build(name, "base"), prompt, steps)
    except Exception as e:  # transformers' export recipe does not take every cache layout
        return f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=["gpt2", "gemma3"], default="gpt2")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--no-compile", action="store_true", help="skip torch.compile")
    parser.add_argument("--no-executorch", action="store_true", help="skip the ExecuTorch export")
    a = parser.parse_args()
    torch.manual_seed(0)
    model = models.build(a.model, "base")
    prompt = models.example_inputs(a.model, model, seq=PROMPT)["input_ids"]
    engines: dict = {"eager (static cache)": Decoder(model, prompt, a.steps, CACHE)}
    build_s: dict[str, float] = {}
    if not a.no_compile:
        engines["torch.compile"] = Decoder(torch.compile(model), prompt, a.steps, CACHE)
    with tempfile.TemporaryDirectory() as tmp:
        for scheme in (None, "int8", "int4"):
            name = f"bundle[ort] {scheme or 'fp32'}"
            loaded, build_s[name] = _bundle(models.build(a.model, "base"), ["ort"], scheme, Path(tmp))
            engines[name] = BundleDecoder(loaded, prompt, a.steps)
        skipped = {}
        if not a.no_executorch:
            started = time.perf_counter()
            made = _executorch(a.model, prompt, a.steps)
            if isinstance(made, str):
                skipped["executorch[xnnpack] fp32"] = made
            else:
                engines["executorch[xnnpack] fp32"] = made
                build_s["executorch[xnnpack] fp32"] = time.perf_counter() - started
        tokens, first = {}, {}
        for k, d in engines.items():
            first[k] = elapsed(lambda: tokens.__setitem__(k, d()))
        interleave(engines, a.runs)
    eager_ms = statistics.median(engines["eager (static cache)"].decode_s[1:]) / a.steps * 1e3
    compiled_ms = statistics.median(engines["torch.compile"].decode_s[1:]) / a.steps * 1e3 if not a.no_compile else None
    rows = []
    for k, d in engines.items():
        ms = statistics.median(d.decode_s[1:]) / a.steps * 1e3
        rows.append({"engine": k, "build_s": build_s.get(k), "first_s": first[k], "step_ms": ms, "tokens_per_s": 1e3 / ms,
                     "x_eager": eager_ms / ms, "x_compile": compiled_ms / ms if compiled_ms else None,
                     "same_tokens": f"{sum(x == y for x, y in zip(tokens[k], tokens['eager (static cache)']))}/{a.steps}"})
    what = "GPT-2 small" if a.model == "gpt2" else f"Gemma-3-style (window {model.config.sliding_window})"
    print(f"{what}, static cache {CACHE}, prompt {PROMPT}, {a.steps} decode steps, {torch.get_num_threads()} threads")
    print(table(rows, [("engine", "{}"), ("build_s", "{:.1f}"), ("first_s", "{:.2f}"), ("step_ms", "{:.2f}"),
                       ("tokens_per_s", "{:.1f}"), ("x_eager", "{:.2f}"), ("x_compile", "{:.2f}"), ("same_tokens", "{}")]))
    for k, why in skipped.items():
        print(f"{k}: not run ({why})")
    name = "bundle_generate" + ("" if a.model == "gpt2" else f"_{a.model}")
    print(f"written {write(name, {'model': a.model, 'rows': rows, 'skipped': skipped, 'steps': a.steps, 'cache': CACHE, 'prompt': PROMPT})}")


if __name__ == "__main__":
    main()

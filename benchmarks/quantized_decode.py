"""Quantized weights on ONNX Runtime's low-bit kernels, beside llama.cpp on the same weights:
greedy decoding (a static KV cache of 128 positions, 32 new tokens) of GPT-2 small and a
Llama-style model (the llama base preset, 4 layers), and BERT-base prefill; eager float32 against
torchnative.accelerate with `ort` in float32, `quantize="int8"` (MatMulInteger on dynamically
quantized activations) and `quantize="int4"` (MatMulNBits, blocks of 32, int8 activations), and
candle's q4k (GPT-2); llama.cpp (llama-cpp-python, benchmarks/llamacpp.py) in f32, f16, Q8_0 and
Q4_0 with the same tensors quantized (skipped, with the reason, where it is not installed).

    python benchmarks/quantized_decode.py [--steps 32] [--prompt 16] [--runs 3] [--bert-seq 128]
        [--only decode|step|prefill] [--models gpt2,llama4] [--busy]

Random weights (torch.manual_seed(0)), nothing downloaded. Accuracy per scheme: one decode step's
logits (every engine given the same token) against eager float32 and against the eager model with
the weights the scheme dequantizes to (passes.quantize.dequantized_copy; for ort's integer
kernels with the activations they quantize too), max and mean absolute error, and greedy tokens
shared with each over the decode. One decode step of GPT-2 at position 128 is also timed against
ONNX Runtime standalone (the step exported whole) in float32, int8 (its quantize_dynamic, per
channel) and int4 (its MatMulNBitsQuantizer, blocks of 32, symmetric, accuracy_level 4). Engines
interleaved with idle gaps (common.interleave). Prints tables; writes
benchmarks/results/quantized_decode.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import contextlib
import importlib.util
import json
import os
import tempfile
import statistics
import subprocess
import sys
import time
import warnings
from pathlib import Path

import torch

from torchnative import models
from torchnative.passes.quantize import dequantized_copy

sys.path.insert(0, str(Path(__file__).parent))
import llamacpp  # noqa: E402
from candle_decode import Decoder  # noqa: E402
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")
CACHE = 128
WARM = 3  # calls after the first before timing, each followed by wait_for_compiles
THREADS = os.cpu_count()  # llama.cpp's, as ONNX Runtime's intra-op pool: one per core
# (row name, delegate, quantize)
ENGINES = [("accel[ort] fp32", "ort", None), ("accel[ort] int8", "ort", "int8"), ("accel[ort] int4", "ort", "int4"),
           ("accel[candle-q4k]", "candle-q4k", None)]


def _logits(model, prompt: torch.Tensor, token: int) -> torch.Tensor:
    """A decode step's logits: `token` after the prompt's prefill, on a fresh static cache. Every
    engine is given the same token: a greedy token of its own prefill would flip on a near tie
    (random weights have many) and make the step another step."""
    d = Decoder(model, prompt, 1, CACHE)
    with torch.no_grad():
        d.prefill()
        return d.model(torch.tensor([[token]]), past_key_values=d.cache,
                       cache_position=torch.tensor([prompt.shape[1]])).logits[0, -1]


def _same(a: list[int], b: list[int]) -> str:
    return f"{sum(x == y for x, y in zip(a, b))}/{len(a)}"


def _llama4():
    """A Llama-style model: the `llama` base preset's sizes, 4 layers."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**{**models.PRESETS["llama"]["base"], "num_hidden_layers": 4})
    return transformers.LlamaForCausalLM(config).eval()


# the decoded models: name → (model factory, its example inputs' short name, candle's row or not)
MODELS = {"gpt2": (lambda: models.build("gpt2", "base"), "gpt2", True), "llama4": (_llama4, "llama", False)}


def _llama_cpp(model, prompt: torch.Tensor, steps: int, where: Path) -> tuple[dict, str]:
    """llama.cpp's decoders on `model`'s tensors (benchmarks/llamacpp.py), or why there are none."""
    why = llamacpp.missing()
    if why:
        return {}, why
    f32 = llamacpp.write_f32(model, where / "model.gguf")
    return {f"llama.cpp {k}": llamacpp.LlamaCppDecoder(llamacpp.quantized(f32, k), prompt, steps, THREADS)
            for k in llamacpp.TYPES}, ""


@contextlib.contextmanager
def _busy_core(busy: bool):
    """With `busy`, another process spins on a core meanwhile: a machine that is not the
    benchmark's alone (whose runtime's thread pool degrades less?)."""
    if not busy:
        yield
        return
    spinner = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        yield
    finally:
        spinner.kill()
        spinner.wait()


def decode(a, name: str) -> list[dict]:
    factory, inputs_of, with_candle = MODELS[name]
    model = factory()
    prompt = models.example_inputs(inputs_of, model, seq=a.prompt)["input_ids"]
    decoders = {"eager fp32": Decoder(model, prompt, a.steps, CACHE)}
    schemes = {"eager fp32": None}
    for row, delegate, scheme in ENGINES if with_candle else ENGINES[:3]:
        accelerated = torchnative.accelerate(factory(), delegates=[delegate], quantize=scheme)
        decoders[row], schemes[row] = Decoder(accelerated, prompt, a.steps, CACHE), scheme or ("q4k" if "q4k" in row else None)
    rows = {k: {"engine": k} for k in decoders}
    tokens = {}
    for k, d in decoders.items():
        rows[k]["first_s"] = elapsed(lambda: tokens.__setitem__(k, d()))
    for d in decoders.values():  # steady state: its programs compiled (they build in the background)
        for _ in range(WARM):
            d()
            torchnative.wait_for_compiles()
        d.decode_s.clear()
    with tempfile.TemporaryDirectory() as where:
        native, skipped = _llama_cpp(model, prompt, a.steps, Path(where))
        for k, d in native.items():
            rows[k] = {"engine": k, "first_s": elapsed(lambda: tokens.__setitem__(k, d()))}
            d.decode_s.clear()
        with _busy_core(a.busy):
            interleave({**decoders, **native}, a.runs)
        token = int(decoders["eager fp32"].prefill())  # the token every engine's logits are taken after
        exact = _logits(model, prompt, token)
        logits = {k: _logits(d.model, prompt, token) for k, d in decoders.items()}
        logits.update({k: d.logits(token) for k, d in native.items()})
        eager_ms = statistics.median(decoders["eager fp32"].decode_s) / a.steps * 1e3
        for k, d in {**decoders, **native}.items():
            r = rows[k]
            r["step_ms"] = statistics.median(d.decode_s) / a.steps * 1e3
            r["tokens_per_s"], r["x_eager"] = 1e3 / r["step_ms"], eager_ms / r["step_ms"]
            r["same_tokens_fp32"] = _same(tokens[k], tokens["eager fp32"])
            if k == "eager fp32":
                continue
            got = logits[k]
            r["max_err_fp32"], r["mean_err_fp32"] = (got - exact).abs().max().item(), (got - exact).abs().mean().item()
            scheme = schemes.get(k)
            if scheme:  # against eager with the weights the scheme dequantizes to, and for ort's
                # integer kernels with the activations they quantize (passes.quantize.low_bit_activations)
                ref = dequantized_copy(model, scheme, activations=k.startswith("accel[ort]"))
                want = _logits(ref, prompt, token)
                r["max_err_deq"], r["mean_err_deq"] = (got - want).abs().max().item(), (got - want).abs().mean().item()
                r["same_tokens_deq"] = _same(tokens[k], Decoder(ref, prompt, a.steps, CACHE)())
    print(f"{name} (random weights){', another process spinning on a core' if a.busy else ''}, greedy decoding of {a.steps} tokens after a {a.prompt}-token prompt, "
          f"static cache of {CACHE}, {THREADS} threads (llama.cpp's; ort's are the cores'); medians of {a.runs} interleaved runs; logits "
          f"of one decode step after the same token (max |logit| {exact.abs().max().item():.2f}); err_deq: against "
          f"eager with the dequantized weights (ort's rows: and its kernels' quantized activations)")
    if skipped:
        print(f"llama.cpp rows skipped: {skipped}")
    cols = [("engine", "{}"), ("tokens_per_s", "{:.1f}"), ("step_ms", "{:.2f}"), ("x_eager", "{:.2f}x"),
            ("max_err_fp32", "{:.3g}"), ("mean_err_fp32", "{:.3g}"), ("max_err_deq", "{:.3g}"), ("mean_err_deq", "{:.3g}"),
            ("same_tokens_fp32", "{}"), ("same_tokens_deq", "{}"), ("first_s", "{:.1f}")]
    print(table(list(rows.values()), cols))
    return list(rows.values())


def _bench_models():
    spec = importlib.util.spec_from_file_location("bench_models", Path(__file__).parent / "models.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gemm_as_matmul(proto):
    """Gemm(A, B, C) of a weight B → MatMul(A, B) + C: ONNX Runtime's 4-bit quantizer takes MatMul
    alone, and the export writes GPT-2's Conv1D layers as Gemm."""
    from onnx import helper, numpy_helper

    weights = {i.name: i for i in proto.graph.initializer}
    nodes = []
    for n in proto.graph.node:
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        if n.op_type != "Gemm" or n.input[1] not in weights or attrs.get("transA", 0) or attrs.get("alpha", 1.0) != 1.0 \
                or attrs.get("beta", 1.0) != 1.0:
            nodes.append(n)
            continue
        if attrs.get("transB", 0):
            w = weights[n.input[1]]
            w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).T.copy(), w.name))
        product = n.output[0] + "_product"
        nodes.append(helper.make_node("MatMul", n.input[:2], [product if len(n.input) > 2 else n.output[0]]))
        if len(n.input) > 2:
            nodes.append(helper.make_node("Add", [product, n.input[2]], [n.output[0]]))
    del proto.graph.node[:]
    proto.graph.node.extend(nodes)
    return proto


def _ort_int4(proto):
    """ONNX Runtime's own 4-bit quantizer, as our int4: blocks of 32, symmetric, int8 compute."""
    from onnxruntime.quantization.matmul_nbits_quantizer import MatMulNBitsQuantizer

    q = MatMulNBitsQuantizer(_gemm_as_matmul(proto), bits=4, block_size=32, is_symmetric=True, accuracy_level=4)
    q.process()
    return q.model.model


def _ort_int8(proto):
    """ONNX Runtime's dynamic quantization, as our int8: per-channel int8 weights, MatMulInteger."""
    import onnx
    from onnxruntime.quantization import QuantType, quantize_dynamic

    with tempfile.TemporaryDirectory() as d:
        src, dst = Path(d) / "fp32.onnx", Path(d) / "int8.onnx"
        onnx.save(proto, src)
        quantize_dynamic(src, dst, per_channel=True, weight_type=QuantType.QInt8, op_types_to_quantize=["MatMul", "Gemm"])
        return onnx.load(dst)


def step(a) -> list[dict]:
    """One decode step at position 128 over a 128-token past, the workload of benchmarks/models.py,
    against ONNX Runtime standalone on the whole step exported, in float32 and quantized by its own
    tools with the same schemes."""
    bench = _bench_models()
    factory, run, standalone = bench._workload("gpt2-decode")
    ids = models.example_inputs("gpt2", factory(), seq=128)["input_ids"]
    engines = {"eager fp32": lambda m=factory(): run(m)}
    for name, delegate, scheme in ENGINES[:3]:
        m = torchnative.accelerate(factory(), delegates=[delegate], quantize=scheme)
        engines[name] = lambda m=m: run(m)
    for name, transform in (("ort standalone fp32", None), ("ort standalone int8", _ort_int8),
                            ("ort standalone int4", _ort_int4)):
        engines[name] = bench._ort_decode_standalone(factory(), ids, transform)
    with torch.no_grad():
        for fn in engines.values():
            for _ in range(3):  # accelerate: recorded, compiled, replayed
                fn()
        times = interleave(engines, a.runs, inner=5, min_s=2.0)
    rows = [{"engine": k, "step_ms": t * 1e3, "x_eager": times["eager fp32"] / t} for k, t in times.items()]
    for r in rows:
        scheme = r["engine"].split()[-1]
        if r["engine"].startswith("accel") and scheme != "fp32":
            r["x_standalone_same_scheme"] = times[f"ort standalone {scheme}"] / times[r["engine"]]
    print("GPT-2 small, one decode step at position 128 over a 128-token past (benchmarks/models.py's gpt2-decode); "
          f"medians of {a.runs} interleaved rounds")
    print(table(rows, [("engine", "{}"), ("step_ms", "{:.2f}"), ("x_eager", "{:.2f}x"),
                       ("x_standalone_same_scheme", "{:.2f}x")]))
    return rows


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
    p.add_argument("--only", choices=["decode", "step", "prefill"])
    p.add_argument("--models", default="gpt2,llama4", help=f"decoded models, of {sorted(MODELS)}")
    p.add_argument("--busy", action="store_true", help="decode timed with another process spinning on a core")
    a = p.parse_args()
    payload = {"torch": torch.__version__, "steps": a.steps, "prompt": a.prompt, "cache": CACHE}
    previous = Path(__file__).parent / "results" / "quantized_decode.json"
    if a.only and previous.exists():  # one part measured again: the others' last figures stay
        payload = {**json.loads(previous.read_text()), **payload}
    if a.only in (None, "decode"):
        payload["decode_busy" if a.busy else "decode"] = {name: decode(a, name) for name in a.models.split(",")}
    for part, fn in (("step", step), ("prefill", prefill)):
        if a.only in (None, part):
            payload[part] = fn(a)
    print(f"wrote {write('quantized_decode', payload)}")


if __name__ == "__main__":
    main()

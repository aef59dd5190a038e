"""Model workloads: eager vs torch.compile vs torchnative.accelerate per delegate vs ONNX Runtime
standalone (the whole model exported), in one run, engines interleaved with idle gaps.

    python benchmarks/models.py [--workloads bert,vit,resnet,gpt2-prefill,gpt2-decode] [--runs 20]
                                [--delegates default,ort,xnnpack,iree-cpu,vulkan,qnn,coreml] [--no-compile]

Each engine's time is the median over at least --runs rounds, and over as many as 2 s of eager
calls take for the fast workloads (~50 for a GPT-2 decode step). Prints a table of median ms,
speed-up over eager and seconds until compiled (the first call; accelerate's first two, as it
compiles on the second); writes benchmarks/results/models.json.
"""
from __future__ import annotations

import torchnative  # before torch: a short OpenMP spin, as users are told (torchnative/threads.py)

import argparse
import gc
import math
import sys
import warnings
from pathlib import Path

import torch

from torchnative import models
from torchnative.cache.program_cache import clear_caches

sys.path.insert(0, str(Path(__file__).parent))
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")


def _workload(name: str):
    """(model factory, inputs or a step function, ONNX Runtime standalone builder) for one
    workload, base-size configs, random weights."""
    if name in ("bert", "vit", "resnet"):
        m = models.build(name, "base")
        inputs = models.example_inputs(name, m, **({"seq": 128} if name == "bert" else {}))
        return lambda: models.build(name, "base"), inputs, lambda model: _ort_standalone(model, inputs)
    if name in ("llama-prefill", "gpt2-prefill"):  # llama: not in the default set (issue 3's are the five)
        arch = name.split("-")[0]
        m = models.build(arch, "base")
        inputs = {"input_ids": models.example_inputs(arch, m, seq=128)["input_ids"], "use_cache": False}
        return lambda: models.build(arch, "base"), inputs, lambda model: _ort_standalone(model, inputs)
    if name == "gpt2-decode":
        from transformers import StaticCache
        m = models.build("gpt2", "base")
        ids = models.example_inputs("gpt2", m, seq=128)["input_ids"]
        # 129 slots: the 128-token past and this step's token, what the standalone's cache holds
        # after its concat; a larger static cache would also attend over (masked) empty slots
        cache = StaticCache(config=m.config, max_cache_len=129)
        with torch.no_grad():
            m(ids, past_key_values=cache, cache_position=torch.arange(128))
        # one decode step at position 128. StaticCache keeps its own write position (a tensor per
        # layer, ignoring cache_position), so each engine's call first puts it back to 128.
        counters = [layer.cumulative_length for layer in cache.layers]
        at = [torch.tensor(128)] * len(counters)
        # the step's inputs made once, as the standalone's feed is: only the engines' work is timed
        last, position = ids[:, -1:], torch.tensor([128])

        def step(model):
            torch._foreach_copy_(counters, at)  # one call: the reset is the harness's, not the engine's
            return model(input_ids=last, past_key_values=cache, cache_position=position)
        return lambda: models.build("gpt2", "base"), step, lambda model: _ort_decode_standalone(model, ids)
    raise ValueError(name)


def _session(model_proto):
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3
    return ort.InferenceSession(model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])


def _ort_standalone(model, inputs):
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)  # flags become constants
    session = _session(program.model_proto)
    feed = {i.name: tensors[i.name].numpy() for i in session.get_inputs()}
    return lambda: session.run(None, feed)


class _DecodeStep(torch.nn.Module):
    """One decode step with the past as flat tensors (k0, v0, k1, v1, ...) and the new past as
    outputs, as an ONNX Runtime decoder runs it; the DynamicCache is built inside forward, so the
    exported graph's inputs are plain tensors."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, input_ids, position_ids, *past):
        from transformers import DynamicCache
        cache = DynamicCache(ddp_cache_data=list(zip(past[0::2], past[1::2])))
        out = self.model(input_ids=input_ids, position_ids=position_ids, past_key_values=cache, use_cache=True)
        return out.logits, *(t for layer in out.past_key_values.layers for t in (layer.keys, layer.values))


def _ort_decode_standalone(model, ids, transform=None):
    """The decode step exported whole: position 128 over the 128-token past of `ids`;
    `transform`: ModelProto → ModelProto (a quantizer) before the session is made."""
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True).past_key_values
        past = [t for layer in cache.layers for t in (layer.keys, layer.values)]
        args = (ids[:, -1:], torch.tensor([[ids.shape[1]]]), *past)
        names = ["input_ids", "position_ids"] + [f"past_{kv}_{i}" for i in range(len(past) // 2) for kv in "kv"]
        program = torch.onnx.export(_DecodeStep(model), args, input_names=names, dynamo=True, verbose=False)
    session = _session(transform(program.model_proto) if transform else program.model_proto)
    feed = dict(zip(names, (a.numpy() for a in args)))
    feed = {i.name: feed[i.name] for i in session.get_inputs()}
    return lambda: session.run(None, feed)


def _first_call(row: dict, engines: dict, name: str, make, calls: int = 1) -> None:
    """Build engine `name`, time its first `calls` calls (until it is compiled) and check that a
    further call runs; a failure is recorded in the row, not fatal."""
    try:
        run = None

        def first():
            nonlocal run
            run = make()
            for _ in range(calls):
                run()

        row[f"{name}_first_s"] = elapsed(first)
        run()
        engines[name] = run
    except Exception as e:
        row.pop(f"{name}_first_s", None)
        row[f"{name}_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"


def bench(name: str, runs: int, delegates: list[str], with_compile: bool) -> dict:
    factory, inputs, standalone = _workload(name)
    call = inputs if callable(inputs) else (lambda m: m(**inputs))
    row: dict = {"workload": name}
    engines: dict = {}
    with torch.no_grad():
        eager_model = factory()
        engines["eager"] = lambda: call(eager_model)
        if with_compile:
            _first_call(row, engines, "torch.compile", lambda: (lambda m: lambda: call(m))(torch.compile(factory())))
        for d in delegates:
            label = "accel[default]" if d == "default" else f"accel[{d}]"
            chosen = None if d == "default" else [d]
            _first_call(row, engines, label,  # compile_after=2: the second call compiles
                        lambda: (lambda m: lambda: call(m))(torchnative.accelerate(factory(), delegates=chosen)), 2)
        _first_call(row, engines, "ort_standalone", lambda: standalone(factory()))
        med = interleave(engines, runs, min_s=2.0)
    engines.clear()
    clear_caches()  # compiled programs hold their own copies of the weights: free them per workload
    gc.collect()
    for k, v in med.items():
        row[f"{k}_ms"] = v * 1e3
        row[f"{k}_x"] = med["eager"] / v
    return row


# engines whose times here are not their device's speed
SIMULATED = {"qnn": "Hexagon HTP run by the QNN simulator on this x86_64 CPU: simulator times, not NPU speed",
             "vulkan": "software Vulkan (Mesa lavapipe) on this CPU: not a GPU's speed",
             "coreml": "compile-only here (Core ML predicts on macOS/iOS only): its partitions run on eager"}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="bert,vit,resnet,gpt2-prefill,gpt2-decode")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--delegates", default="default,ort,xnnpack", help="'default' is accelerate's default set")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    delegates = [d for d in a.delegates.split(",") if d]
    notes = {f"accel[{d}]": SIMULATED[d] for d in delegates if d in SIMULATED}
    name = "models" if not notes else "models_" + "_".join(d for d in delegates if d in SIMULATED)
    rows = []
    for workload in a.workloads.split(","):
        try:
            rows.append(bench(workload, a.runs, delegates, not a.no_compile))
        except Exception as e:  # one broken workload must not lose the others' figures
            rows.append({"workload": workload, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        done = {k[:-2]: round(v, 2) for k, v in rows[-1].items() if k.endswith("_x")}
        print(f"  done {workload}: {rows[-1].get('error', done)}", flush=True)
        # kept as it goes: a long run stopped halfway keeps the workloads it finished
        write(name, {"torch": torch.__version__, "rows": rows, "notes": notes, "complete": False})
    engines = ["eager", "torch.compile", *(f"accel[{d}]" for d in delegates), "ort_standalone"]
    for r in rows:
        for e in engines:
            if f"{e}_error" in r:
                print(f"  {r['workload']} / {e}: {r[f'{e}_error']}")
    cols = [("workload", "{}")] + [(f"{e}_ms", "{:.1f}") for e in engines] + [(f"{e}_x", "{:.2f}x") for e in engines[1:]] \
        + [(f"{e}_first_s", "{:.1f}") for e in engines[1:]]
    print(table(rows, cols))
    for d in delegates:
        if d in SIMULATED:
            print(f"accel[{d}]: {SIMULATED[d]}")
    geo = {}
    for e in engines[1:]:
        xs = [r[f"{e}_x"] for r in rows if f"{e}_x" in r]
        if xs:
            geo[e] = math.exp(sum(map(math.log, xs)) / len(xs))
    print("geomean speed-up over eager: " + ", ".join(f"{e} {g:.2f}x" for e, g in geo.items()))
    vs = {r["workload"]: r["accel[default]_ms"] and r["ort_standalone_ms"] / r["accel[default]_ms"]
          for r in rows if "accel[default]_ms" in r and "ort_standalone_ms" in r}
    if vs:
        print("accel[default] vs ort_standalone (>1 is faster): "
              + ", ".join(f"{w} {x:.2f}x" for w, x in vs.items()))
    print(f"wrote {write(name, {'torch': torch.__version__, 'rows': rows, 'geomean': geo, 'notes': notes, 'complete': True})}")


if __name__ == "__main__":
    main()

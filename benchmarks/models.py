"""Model workloads: eager vs torch.compile vs torchnative.accelerate per delegate vs ONNX Runtime
standalone (the whole model exported), in one run, engines interleaved with idle gaps.

    python benchmarks/models.py [--workloads bert,vit,resnet,gpt2-prefill,gpt2-decode] [--runs 20]
                                [--delegates default,ort,xnnpack,iree-cpu,vulkan,qnn,coreml] [--no-compile]

Prints a table of median ms, speed-up over eager and seconds until compiled (the first call;
accelerate's first two, as it compiles on the second); writes benchmarks/results/models.json.
"""
from __future__ import annotations

import argparse
import gc
import math
import sys
import warnings
from pathlib import Path

import torch

import torchnative
from torchnative import models
from torchnative.runtime.program import clear_caches

sys.path.insert(0, str(Path(__file__).parent))
from common import elapsed, interleave, table, write  # noqa: E402

warnings.filterwarnings("ignore")


def _workload(name: str):
    """(model factory, inputs) for one workload, base-size configs, random weights."""
    if name == "bert":
        m = models.build("bert", "base")
        return lambda: models.build("bert", "base"), models.example_inputs("bert", m, seq=128)
    if name == "vit":
        m = models.build("vit", "base")
        return lambda: models.build("vit", "base"), models.example_inputs("vit", m)
    if name == "resnet":
        m = models.build("resnet", "base")
        return lambda: models.build("resnet", "base"), models.example_inputs("resnet", m)
    if name == "llama-prefill":  # not in the default set: issue 3's workloads are the five above and below
        m = models.build("llama", "base")
        ids = models.example_inputs("llama", m, seq=128)["input_ids"]
        return lambda: models.build("llama", "base"), {"input_ids": ids, "use_cache": False}
    if name == "gpt2-prefill":
        m = models.build("gpt2", "base")
        ids = models.example_inputs("gpt2", m, seq=128)["input_ids"]
        return lambda: models.build("gpt2", "base"), {"input_ids": ids, "use_cache": False}
    if name == "gpt2-decode":
        from transformers import StaticCache
        m = models.build("gpt2", "base")
        ids = models.example_inputs("gpt2", m, seq=128)["input_ids"]
        cache = StaticCache(config=m.config, max_cache_len=160)
        with torch.no_grad():
            m(ids, past_key_values=cache, cache_position=torch.arange(128))
        # one decode step at position 128. StaticCache keeps its own write position (a tensor per
        # layer, ignoring cache_position), so each engine's call first puts it back to 128.
        def step(model):
            for layer in cache.layers:
                layer.cumulative_length.fill_(128)
            return model(input_ids=ids[:, -1:], past_key_values=cache, cache_position=torch.tensor([128]))
        return lambda: models.build("gpt2", "base"), step
    raise ValueError(name)


def _ort_standalone(model, inputs):
    import onnxruntime as ort

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    program = torch.onnx.export(model, (), kwargs=inputs, dynamo=True, verbose=False)  # flags become constants
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {i.name: tensors[i.name].numpy() for i in session.get_inputs()}
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
    factory, inputs = _workload(name)
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
        if not callable(inputs):  # a cache object does not export as a plain input
            _first_call(row, engines, "ort_standalone", lambda: _ort_standalone(factory(), inputs))
        med = interleave(engines, runs)
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

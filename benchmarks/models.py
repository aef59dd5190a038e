"""Model workloads: eager vs torch.compile vs torchnative.accelerate per delegate vs ONNX Runtime
standalone (the whole model exported), in one run, engines interleaved with idle gaps.

    python benchmarks/models.py [--workloads bert,vit,resnet,gpt2-prefill[,gpt2-decode]] [--runs 20]
                                [--delegates ort] [--no-compile]

Prints a table of median ms, speed-up over eager and first-call seconds; writes
benchmarks/results/models.json.
"""
from __future__ import annotations

import argparse
import math
import sys
import warnings
from pathlib import Path

import torch

import torchnative
from torchnative import models

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
        # one decode step at position 128; repeating it rewrites the same cache slot
        return (lambda: models.build("gpt2", "base"),
                {"input_ids": ids[:, -1:], "past_key_values": cache, "cache_position": torch.tensor([128])})
    raise ValueError(name)


def _ort_standalone(model, inputs):
    import onnxruntime as ort

    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    if len(tensors) != len(inputs):
        return None  # cache objects and flags do not export as plain inputs
    program = torch.onnx.export(model, (), kwargs=tensors, dynamo=True, verbose=False)
    options = ort.SessionOptions()
    options.intra_op_num_threads = torch.get_num_threads()
    options.log_severity_level = 3
    session = ort.InferenceSession(program.model_proto.SerializeToString(), options, providers=["CPUExecutionProvider"])
    feed = {i.name: tensors[i.name].numpy() for i in session.get_inputs()}
    return lambda: session.run(None, feed)


def bench(name: str, runs: int, delegates: list[str], with_compile: bool) -> dict:
    factory, inputs = _workload(name)
    row: dict = {"workload": name}
    engines = {}
    with torch.no_grad():
        eager_model = factory()
        engines["eager"] = lambda: eager_model(**inputs)
        if with_compile:
            compiled = torch.compile(factory())
            row["torch.compile_first_s"] = elapsed(lambda: compiled(**inputs))
            engines["torch.compile"] = lambda: compiled(**inputs)
        for d in delegates:
            accel = torchnative.accelerate(factory(), delegates=[d])
            row[f"accel[{d}]_first_s"] = elapsed(lambda: accel(**inputs))
            engines[f"accel[{d}]"] = (lambda a: lambda: a(**inputs))(accel)
        try:
            t = elapsed(lambda: engines.__setitem__("ort_standalone", _ort_standalone(factory(), inputs)))
            if engines["ort_standalone"] is None:
                del engines["ort_standalone"]
            else:
                row["ort_standalone_first_s"] = t
        except Exception as e:  # an export failure is a result, not a crash of the benchmark
            engines.pop("ort_standalone", None)
            row["ort_standalone_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:120]}"
        med = interleave(engines, runs)
    for k, v in med.items():
        row[f"{k}_ms"] = v * 1e3
        row[f"{k}_x"] = med["eager"] / v
    return row


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--workloads", default="bert,vit,resnet,gpt2-prefill")
    p.add_argument("--runs", type=int, default=20)
    p.add_argument("--delegates", default="ort")
    p.add_argument("--no-compile", action="store_true")
    a = p.parse_args()
    delegates = [d for d in a.delegates.split(",") if d]
    rows = []
    for name in a.workloads.split(","):
        try:
            rows.append(bench(name, a.runs, delegates, not a.no_compile))
        except Exception as e:  # one broken workload must not lose the others' figures
            rows.append({"workload": name, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"})
        print(f"  done {name}: {rows[-1].get('error', 'ok')}", flush=True)
    engines = ["eager", "torch.compile", *(f"accel[{d}]" for d in delegates), "ort_standalone"]
    cols = [("workload", "{}")] + [(f"{e}_ms", "{:.1f}") for e in engines] + [(f"{e}_x", "{:.2f}x") for e in engines[1:]] \
        + [(f"{e}_first_s", "{:.1f}") for e in engines[1:]]
    print(table(rows, cols))
    geo = {}
    for e in engines[1:]:
        xs = [r[f"{e}_x"] for r in rows if f"{e}_x" in r]
        if xs:
            geo[e] = math.exp(sum(map(math.log, xs)) / len(xs))
    print("geomean speed-up over eager: " + ", ".join(f"{e} {g:.2f}x" for e, g in geo.items()))
    print(f"wrote {write('models', {'torch': torch.__version__, 'rows': rows, 'geomean': geo})}")


if __name__ == "__main__":
    main()

"""capture-and-compile → bundle → run (in a fresh process), the bundle's validation, and the disk
cache of compiled partitions. Every output is compared with the eager model's."""
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
import torch

import torchnative
from torchnative import cli, models
from torchnative.bundle import BundleError
from torchnative.delegates import xnnpack
from torchnative.interface import Availability
from torchnative import store
from torchnative.cache.program_cache import clear_caches

ARCHS = ["GPT2LMHeadModel", "BertModel", "ViTModel", "ResNetModel"]


def _eager(arch: str):
    model = models.transformers_model(arch, "tiny")
    inputs = models.default_inputs(model)
    with torch.no_grad():
        out = model(**inputs)
    return model, inputs, {k: v for k, v in out.items()}


def _compile(arch: str, out: Path, *extra: str) -> None:
    """A bundle of one call (a causal LM's bundle generates by default: tests/test_bundle_generate.py)."""
    assert cli.main(["capture-and-compile", f"transformers:{arch}", "--no-generate", "--out", str(out), *extra]) == 0


def _fresh_run(bundle: Path, inputs: dict, tmp: Path) -> dict:
    """`torchnative run` in a new process, inputs from .npy files; its outputs."""
    args = []
    for name, t in inputs.items():
        np.save(tmp / f"{name}.npy", t.numpy())
        args += ["--input", f"{name}={tmp / f'{name}.npy'}"]
    done = subprocess.run([sys.executable, "-m", "torchnative.cli", "run", str(bundle), *args, "--save", str(tmp / "out.npz")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    with np.load(tmp / "out.npz") as saved:
        return {k: torch.from_numpy(saved[k]) for k in saved.files}


def _close(got: dict, expected: dict, rtol: float = 1e-4) -> None:
    assert set(got) == set(expected)
    for k, ref in expected.items():
        torch.testing.assert_close(got[k], ref, rtol=rtol, atol=rtol * float(ref.abs().max()))


@pytest.mark.parametrize("arch", ARCHS)
def test_capture_and_compile_then_run_in_a_fresh_process(arch, tmp_path):
    bundle = tmp_path / "model.bundle"
    _compile(arch, bundle)
    _, inputs, expected = _eager(arch)
    _close(_fresh_run(bundle, inputs, tmp_path), expected)
    manifest = json.loads((bundle / "manifest.json").read_text())
    forward = manifest["methods"]["forward"]
    assert [i["name"] for i in forward["inputs"]] == list(inputs)
    assert {p["delegate"] for g in forward["programs"] for p in g["partitions"]} == {"ort"}
    assert manifest["state"] == [] and "generate" not in manifest
    # each partition was checked against eager when built, and the manifest says how close it came
    assert all(p["gap"] < 1e-4 and p["tolerance"] == "scale 0.0001" for g in forward["programs"] for p in g["partitions"])


@pytest.mark.slow  # ~22 s of XNNPACK lowering
def test_mixed_delegates_with_eager_partitions_as_exported_programs(tmp_path):
    """XNNPACK first declines layer_norm, gelu, embeddings...: those partitions are saved as
    ExportedPrograms, and ONNX Runtime takes what XNNPACK does not."""
    bundle = tmp_path / "bert.zip"
    _compile("BertModel", bundle, "--targets", "xnnpack")
    _, inputs, expected = _eager("BertModel")
    loaded = torchnative.load(bundle)
    kinds = {p["delegate"] for g in loaded.manifest["methods"]["forward"]["programs"] for p in g["partitions"]}
    assert kinds == {"xnnpack", "eager"}
    _close(loaded(**inputs), expected)
    _close(_fresh_run(bundle, inputs, tmp_path), expected)


def test_the_loader_does_not_need_the_model_code(tmp_path):
    bundle = tmp_path / "gpt2.bundle"
    _compile("GPT2LMHeadModel", bundle)
    code = ("import sys, torch, torchnative\n"
            f"b = torchnative.load({str(bundle)!r})\n"
            "out = b(input_ids=torch.zeros(1, 16, dtype=torch.long), attention_mask=torch.ones(1, 16, dtype=torch.long))\n"
            "assert out['logits'].shape == (1, 16, 1000)\n"
            "assert 'transformers' not in sys.modules, 'the loader imported transformers'\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


FACTORY = '''
import torch


class Adapted(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.GELU(), torch.nn.Linear(64, 32))
        self.adapter = torch.nn.Linear(32, 32)

    def forward(self, x):
        return self.adapter(self.body(x)).relu()


def make():
    return Adapted(), {"x": torch.randn(4, 32)}
'''


def test_factory_file_pin_quantize_and_update_a_pinned_weight(tmp_path):
    (tmp_path / "adapted.py").write_text(FACTORY)
    bundle = tmp_path / "adapted.zip"
    assert cli.main(["capture-and-compile", f"{tmp_path / 'adapted.py'}:make", "--pin", "adapter.*",
                     "--quantize", "int8", "--out", str(bundle)]) == 0
    sys.path.insert(0, str(tmp_path))
    try:
        import adapted
    finally:
        sys.path.remove(str(tmp_path))
    model, inputs = adapted.make()
    loaded = torchnative.load(bundle)
    assert set(loaded.pinned) == {"adapter.weight", "adapter.bias"}
    # pinned weights stay float inputs; the body's matmul weights are stored as int8
    assert loaded.weights["adapter.weight"].dtype == torch.float32
    assert any(w.dtype == torch.int8 for w in loaded.weights.values())
    assert "body.0.weight" not in loaded.weights or loaded.weights["body.0.weight"].dtype != torch.float32
    with torch.no_grad():
        _close(loaded(**inputs), {"output": model(**inputs)}, rtol=2e-2)
        new = torch.randn(32, 32)
        loaded.update("adapter.weight", new)
        model.adapter.weight.copy_(new)
        _close(loaded(**inputs), {"output": model(**inputs)}, rtol=2e-2)
    with pytest.raises(BundleError, match="not a pinned tensor"):
        loaded.update("body.0.weight", torch.zeros(64, 32))
    with pytest.raises(BundleError, match=r"is float32\[32, 32\], got float32\[3\]"):
        loaded.update("adapter.weight", torch.zeros(3))


# -- validation: every bad bundle or input gives a message that names it ------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    path = tmp_path_factory.mktemp("good") / "gpt2.bundle"
    _compile("GPT2LMHeadModel", path, "--targets", "xnnpack,ort")
    return path


@pytest.fixture
def copy(good, tmp_path):
    target = tmp_path / "copy.bundle"
    shutil.copytree(good, target)
    return target


def _inputs(seq=16, dtype=torch.long):
    return {"input_ids": torch.zeros(1, seq, dtype=dtype), "attention_mask": torch.ones(1, seq, dtype=dtype)}


def _artifact(bundle: Path, delegate: str) -> Path:
    return next(p for p in sorted((bundle / "partitions").iterdir()) if delegate in p.name)


@pytest.mark.parametrize("call, message", [
    (lambda b: b(input_ids=_inputs()["input_ids"]), r"missing: \['attention_mask'\]"),
    (lambda b: b(**_inputs(), token_type_ids=torch.zeros(1, 16, dtype=torch.long)), r"unknown: \['token_type_ids'\]"),
    (lambda b: b(**_inputs(seq=20)), r"'input_ids' must be int64\[1, 16\] \(as captured\), got int64\[1, 20\].*--example-input input_ids=int64\[1,20\]"),
    (lambda b: b(**_inputs(dtype=torch.int32)), r"'input_ids' must be int64\[1, 16\] \(as captured\), got int32\[1, 16\]"),
    (lambda b: b(input_ids=_inputs()["input_ids"], attention_mask=[1] * 16), r"'attention_mask' must be a tensor"),
    # the captured call read `attention_mask` (all ones: no mask needed) to choose its path
    (lambda b: b(input_ids=_inputs()["input_ids"], attention_mask=torch.zeros(1, 16, dtype=torch.long)),
     r"another path through the model.*masking_utils.py.*True.*False"),
])
def test_bad_inputs(good, call, message):
    with pytest.raises(BundleError, match=message):
        call(torchnative.load(good))


def _truncate(b: Path):
    f = _artifact(b, "ort")
    f.write_bytes(f.read_bytes()[:-100])


def _tamper(b: Path):
    f = _artifact(b, "ort")
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))


def _schema(b: Path, value):
    m = json.loads((b / "manifest.json").read_text())
    m["schema"] = value
    (b / "manifest.json").write_text(json.dumps(m))


def _weights(b: Path):
    f = b / "weights.safetensors"
    data = bytearray(f.read_bytes())
    data[-1] ^= 0xFF
    f.write_bytes(bytes(data))


@pytest.mark.parametrize("damage, message", [
    (_truncate, r"partitions/forward_g\d_p\d_ort.onnx .* has \d+ bytes, the manifest says \d+: the file is truncated"),
    (_tamper, r"partitions/forward_g\d_p\d_ort.onnx .* does not match its hash in the manifest"),
    (_weights, r"weights.safetensors .* does not match its hash"),
    (lambda b: _schema(b, 99), r"bundle schema 99, newer than this torchnative reads \(4\); upgrade torchnative"),
    (lambda b: _schema(b, 1), r"bundle schema 1, older than this torchnative reads \(2..4\); write it again"),
    (lambda b: _schema(b, None), r"has no schema version: not a torchnative bundle"),
    (lambda b: (b / "manifest.json").unlink(), r"has no manifest.json: the bundle is incomplete"),
    (lambda b: (b / "manifest.json").write_text("{not json"), r"manifest.json is not valid JSON"),
    (lambda b: _artifact(b, "xnnpack").unlink(), r"has no partitions/.*xnnpack.pte: the bundle is incomplete"),
])
def test_damaged_bundles(copy, damage, message):
    damage(copy)
    with pytest.raises(BundleError, match=message):
        torchnative.load(copy)


def test_a_delegate_missing_here(good, monkeypatch):
    monkeypatch.setattr(xnnpack.delegate, "available",
                        lambda: Availability("unavailable", "executorch is not installed", "pip install executorch==1.5.1"))
    with pytest.raises(BundleError, match=r"needs delegate 'xnnpack' .* cannot execute here: executorch is not "
                                          r"installed; install: pip install executorch==1.5.1"):
        torchnative.load(good)


def test_cli_errors_are_messages_not_tracebacks(good, tmp_path, capsys):
    assert cli.main(["run", str(tmp_path / "nothing")]) == 2
    assert "no bundle at" in capsys.readouterr().err
    np.save(tmp_path / "ids.npy", np.zeros((1, 20), dtype=np.int64))
    assert cli.main(["run", str(good), "--input", f"input_ids={tmp_path / 'ids.npy'}"]) == 2
    assert "must be int64[1, 16] (as captured), got int64[1, 20]" in capsys.readouterr().err
    assert cli.main(["capture-and-compile", "transformers:NoSuchModel", "--out", str(tmp_path / "x")]) == 2
    assert "transformers has no model class 'NoSuchModel'" in capsys.readouterr().err
    assert cli.main(["capture-and-compile", "transformers:BertModel", "--config", "huge"]) == 2
    assert "presets for bert: ['base', 'tiny']" in capsys.readouterr().err
    assert cli.main(["capture-and-compile", "transformers:BertModel", "--example-input", "input_ids=int64(1,16)"]) == 2
    assert "expected name=dtype[shape]" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_inspect_a_bundle_shows_partitions_and_finds_a_tampered_file(good, copy, capsys):
    assert cli.main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "partitions in execution order" in out and "xnnpack" in out and "op coverage" in out
    assert "HASH MISMATCH" not in out
    _tamper(copy)
    assert cli.main(["inspect", str(copy)]) == 0
    assert "HASH MISMATCH" in capsys.readouterr().out


# -- the disk cache ---------------------------------------------------------------------------------
@pytest.fixture
def cache_dir(tmp_path):
    store.set_place(tmp_path / "cache")
    clear_caches()
    yield tmp_path / "cache"
    store.set_place(None)
    clear_caches()


def _accelerated(seed: int, delegates=("ort",)):
    model = models.transformers_model("BertModel", "tiny", seed=seed)
    inputs = models.default_inputs(model)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    torchnative.accelerate(model, delegates=list(delegates), compile_after=1)
    return model, inputs, expected


def _run_cold_then_warm(seed_a: int, seed_b: int, delegates=("ort",)) -> dict:
    model, inputs, expected = _accelerated(seed_a, delegates)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
    clear_caches()  # a new process, as far as compiled programs go
    torchnative.reset_stats()
    model, inputs, expected = _accelerated(seed_b, delegates)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
    return torchnative.stats()["disk_cache"]


def test_second_start_loads_every_partition_and_plan_from_disk(cache_dir):
    warm = _run_cold_then_warm(0, 0)
    assert warm.get("hits", 0) >= 2 and warm.get("plan hits", 0) >= 2 and "misses" not in warm, warm


def test_other_weights_reuse_weightless_ort_artifacts(cache_dir):
    # ONNX Runtime's artifacts name their weights (external initializers): another model of the
    # same shapes reuses them with its own weights, and its outputs are its own
    warm = _run_cold_then_warm(0, 1)
    assert warm.get("hits", 0) >= 2 and "misses" not in warm, warm


def _int4_bert(seed: int):
    """Tiny BERT accelerated on ort with int4 weights, its inputs, and eager's result with the
    weights dequantized (the same graph on eager)."""
    model = models.transformers_model("BertModel", "tiny", seed=seed)
    inputs = models.default_inputs(model)
    with torch.no_grad(), torchnative.capture(["eager"], compile_after=1, quantize="int4"):
        expected = model(**inputs).last_hidden_state + 0
    torchnative.accelerate(model, delegates=["ort"], compile_after=1, quantize="int4")
    return model, inputs, expected


def test_low_bit_layouts_are_made_at_load_from_the_weights_given(cache_dir):
    # the int4 artifact names passes.quantize's int8 values, not MatMulNBits' packed ones: a second
    # start, with another model of the same shapes, reuses the artifact and computes with its own weights
    for seed, cold in ((0, True), (1, False)):
        clear_caches()
        torchnative.reset_stats()
        model, inputs, expected = _int4_bert(seed)
        with torch.no_grad():
            got = model(**inputs).last_hidden_state
        assert not torchnative.stats()["fallbacks"]
        assert (torchnative.stats()["fused"].get("quantized_mm", 0) > 0) == cold  # a warm start compiles nothing
        assert ("misses" in torchnative.stats()["disk_cache"]) == cold, torchnative.stats()["disk_cache"]
        torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * expected.abs().max().item())


def test_an_int4_bundle_runs_the_low_bit_kernel_in_a_fresh_process(tmp_path):
    bundle = tmp_path / "bert.bundle"
    _compile("BertModel", bundle, "--targets", "ort", "--quantize", "int4")
    _, inputs, expected = _int4_bert(0)
    payloads = [f.read_bytes() for f in bundle.rglob("*.onnx")]
    assert payloads and any(n.op_type == "MatMulNBits" for p in payloads for n in onnx.load_from_string(p).graph.node)
    got = _fresh_run(bundle, inputs, tmp_path)["last_hidden_state"]
    torch.testing.assert_close(got, expected, rtol=0, atol=0.05 * expected.abs().max().item())


def _conv(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.ReLU()).eval()


@pytest.mark.parametrize("seeds, hit", [((0, 0), True), ((0, 1), False)])
def test_weights_baked_into_an_artifact_are_part_of_its_key(cache_dir, seeds, hit):
    x = torch.randn(1, 3, 16, 16)
    for seed in seeds:  # cold, then warm (a new process as far as compiled programs go)
        clear_caches()
        torchnative.reset_stats()
        model = _conv(seed)  # XNNPACK bakes a convolution's weights into its .pte
        with torch.no_grad():
            expected = model(x)
            got = torchnative.accelerate(model, delegates=["xnnpack"], compile_after=1)(x)
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
    assert ("hits" in torchnative.stats()["disk_cache"]) == hit, torchnative.stats()["disk_cache"]


def test_a_corrupt_entry_is_detected_and_rebuilt(cache_dir):
    _run_cold_then_warm(0, 0)
    for entry in cache_dir.glob("*.entry"):
        data = bytearray(entry.read_bytes())
        data[-10] ^= 0xFF
        entry.write_bytes(bytes(data))
    for plan in cache_dir.glob("*.plan"):
        plan.write_text('{"partitions": [["ort", ["no_such_node"]]], "declined": {}}')
    clear_caches()
    torchnative.reset_stats()
    model, inputs, expected = _accelerated(0)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).last_hidden_state, expected, rtol=1e-4, atol=1e-5)
    stats = torchnative.stats()["disk_cache"]
    assert stats["corrupt"] == len([*cache_dir.glob("*.entry"), *cache_dir.glob("*.plan")]) and "hits" not in stats, stats
    # a discarded entry's verdict went with it: the rebuilt artifact was checked, its verdict stored again
    assert {v.stem for v in cache_dir.glob("*.verdict")} == {e.stem for e in cache_dir.glob("*.entry")}
    clear_caches()
    torchnative.reset_stats()
    _accelerated(0)[0](**inputs)
    assert "corrupt" not in torchnative.stats()["disk_cache"]  # rebuilt entries are whole again


WORKER = """
import sys, torch, torchnative
from torchnative import models
model = models.transformers_model("BertModel", "tiny")
inputs = models.default_inputs(model)
with torch.no_grad():
    expected = model(**inputs).last_hidden_state
    torchnative.accelerate(model, compile_after=1)
    got = model(**inputs).last_hidden_state
torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)
print(dict(torchnative.stats()["disk_cache"]))
"""


@pytest.mark.slow  # ~18 s: two processes building the same programs
def test_two_processes_sharing_the_cache(tmp_path):
    env = {**os.environ, "TORCHNATIVE_CACHE_DIR": str(tmp_path / "cache")}
    workers = [subprocess.Popen([sys.executable, "-c", WORKER], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True) for _ in range(2)]
    for w in workers:
        out, err = w.communicate(timeout=300)
        assert w.returncode == 0, err[-3000:]
    assert not list((tmp_path / "cache").glob(".*.tmp"))  # no half-written files left behind
    warm = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True, timeout=300)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert "'hits'" in warm.stdout and "'misses'" not in warm.stdout, warm.stdout


def test_a_bundle_method_is_the_replay_trace_it_was_saved_from(tmp_path):
    """The trace a call was captured as, saved and loaded back, is a replay `Trace` again: the same
    programs in order (their partitions' delegates), the same scalar checks and the same outputs,
    and `replay.trace.run` — the interpreter replayed calls run on — runs it to eager's results."""
    from torchnative.bundle.build import compile_call
    from torchnative.bundle.save import save
    from torchnative.replay.trace import Trace, run

    model, inputs, expected = _eager("GPT2LMHeadModel")
    compiled = compile_call(model, inputs, ["ort"])
    saved = compiled.methods["forward"].trace
    save(compiled, tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b").methods["forward"]
    trace = loaded.trace()
    assert isinstance(trace, Trace) and len(trace.calls) == len(saved.calls) >= 2
    for mine, theirs in zip(trace.calls, saved.calls):
        assert [d for d, _ in mine.program.partitions] == [d for d, _ in theirs.program.partitions]
        assert mine.reads == theirs.reads
    assert [s[0] for s in trace.outputs] == [s[0] for s in saved.outputs]
    with torch.no_grad():
        _close(run(trace, [inputs[name] for name in loaded.inputs], {}), expected)
        _close(loaded(**inputs), expected)


def test_one_interpreter_runs_programs_in_order():
    """A trace's programs are called in one place (replay.trace.run), for replays and bundles; a
    program's partitions in one place (build.program.Program._run_steps)."""
    import ast

    root = Path(torchnative.__file__).parent
    callers = set()
    for path in root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            # a step's program, or the one it runs in its place (a stand-in's built program)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) \
                    and node.func.attr in ("program", "program_for") \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "call":
                callers.add(path.relative_to(root).as_posix())
    assert callers == {"replay/trace.py"}

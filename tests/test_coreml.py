"""The `coreml` delegate. Core ML predicts on macOS and iOS only: here the delegate is
compile-only, so its tests prove what this machine can — every claimed op converts and its
package validates (spec, ML program re-parsed with every weight blob), models' partitions compile
and run on eager with the reason, bundles ship the packages — and the execution test runs on macOS."""
import json
import platform
from pathlib import Path

import pytest
import torch
import torch.fx as fx

import torchnative
from tests.conftest import record
from tests.test_bundle import _compile, _eager, _fresh_run, _close
from tests.sweep import sweep
from tests.test_delegates import OPS
from torchnative import events, models
from torchnative.bundle.build import compile_generation
from torchnative.bundle.save import save
from torchnative.delegates import REGISTRY, coreml
from torchnative.ir import CapturedGraph
from torchnative.cache.program_cache import clear_caches

pytestmark = pytest.mark.skipif(REGISTRY["coreml"].available().status == "unavailable",
                                reason=f"coreml: {REGISTRY['coreml'].available().reason}")
ON_MAC = platform.system() == "Darwin"
COMPILE_ONLY = "compile-only on this platform"


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """One disk cache for the module: which ops Core ML takes is probed once; its entries hold
    the packages the tests validate."""
    path = tmp_path_factory.mktemp("coreml-cache")
    torchnative.set_cache_dir(path)
    yield path
    torchnative.set_cache_dir(None)
    clear_caches()


def _packages(cache: Path) -> list[bytes]:
    return [e.read_bytes().split(b"\n", 1)[1] for e in sorted(cache.glob("*.entry"))]


def test_status_is_truthful_here():
    status = torchnative.availability()["coreml"]
    if ON_MAC:
        assert status.status == "executes"
    else:
        assert status.status == "compile-only" and "macOS and iOS only" in status.reason


@pytest.mark.slow  # ~1 min of conversions; the models' and bundles' tests convert the common ops by default
def test_claimed_ops_convert_and_validate(cache, tmp_path):
    r = sweep(tmp_path, "--samples", "1", "--delegates", "coreml", "--ops", ",".join(OPS), cache=cache)
    print(f"coreml: {len(r['delegated'])} of {r['pass'] + r['fallback']} samples converted and validated")
    assert not r["failures"], "\n".join(r["failures"])
    # a claimed op that then failed to convert or validate is a fallback other than compile-only
    assert not r["fallbacks"], "\n".join(r["fallbacks"])
    assert len(r["delegated"]) >= 30, r["delegated"]


# ~15-40 s apiece (each kind of node is converted alone once, then each partition): -m slow (CI
# runs it); the default run converts the op table and a GPT-2 bundle
@pytest.mark.slow
@pytest.mark.parametrize("name", ["gpt2", "resnet", "bert", "vit"])
def test_models_compile_and_fall_back_with_the_reason(cache, name):
    # from clean caches: the programs and templates of earlier tests (a bundle of GPT-2 over a range of
    # sizes) are not what this test is about (a static delegate alone is given the graph at the
    # call's sizes even so: test_sizes.py)
    clear_caches()
    model = models.build(name)
    model.config.use_cache = False
    inputs = models.example_inputs(name, model)
    before = set(cache.glob("*.entry"))
    with torch.no_grad(), record(events.Fallback) as fallbacks:
        expected = model(**inputs)
        with torchnative.capture(["coreml"], compile_after=1):
            got = model(**inputs)
    key = "logits" if "logits" in expected else "last_hidden_state"
    if ON_MAC:
        torch.testing.assert_close(got[key], expected[key], rtol=2e-2, atol=2e-2)  # fp16 on the Neural Engine
        return
    torch.testing.assert_close(got[key], expected[key], rtol=0, atol=0)  # eager ran every partition here
    assert fallbacks and all(f.delegate == "coreml" and f.reason.startswith(COMPILE_ONLY) for f in fallbacks)
    converted = sum(f.n_ops for f in fallbacks)
    total = sum(len(g.op_nodes()) for g in _graphs(model, inputs))
    print(f"{name}: {converted}/{total} ops in Core ML partitions (converted, validated; eager here)")
    assert converted >= 0.8 * total
    new = [e.read_bytes().split(b"\n", 1)[1] for e in set(cache.glob("*.entry")) - before]
    assert new
    for payload in new:
        described = coreml.describe(payload)
        assert described["spec_version"] >= 9 and sum(described["ops"].values()) > 0  # iOS 18: spec 9


def _graphs(model, inputs) -> list:
    with torch.no_grad(), torchnative.capture(["eager"], compile_after=1):
        return torchnative.explain(model, **inputs).graphs


def test_weight_compression_shrinks_the_package(cache):
    x = torch.randn(4, 256)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(), torch.nn.Linear(512, 256))
    with torch.no_grad(), record(events.PartitionCompiled) as compiled, torchnative.capture(["coreml"], compile_after=1):
        y = mlp(x)  # kept: a result nobody holds is never computed
    graph = max((e.step.graph for e in compiled), key=lambda g: len(g.op_nodes()))  # the partition, weights included
    assert len(graph.constants) == 4 and y.shape == (4, 256)
    sizes, ops = {}, {}
    for how in (None, "int8", "int4", "palettize4"):
        artifact = coreml.CoreML(compress=how).compile(graph)
        sizes[how], ops[how] = len(artifact.payload), artifact.meta["ops"]
    print({k or "float16": f"{v / 1024:.0f} KiB" for k, v in sizes.items()})
    assert sizes["int8"] < 0.6 * sizes[None] and sizes["int4"] < sizes["int8"] and sizes["palettize4"] < sizes["int8"]
    assert "constexpr_blockwise_shift_scale" in ops["int8"] and "constexpr_lut_to_dense" in ops["palettize4"]


def test_a_damaged_package_does_not_validate(cache):
    import io
    import zipfile

    payload = next(p for p in _packages(cache) if b"weight.bin" in p)
    out = io.BytesIO()
    with zipfile.ZipFile(io.BytesIO(payload)) as z, zipfile.ZipFile(out, "w") as w:
        for n in z.namelist():
            data = z.read(n)
            w.writestr(n, data[: len(data) // 2] if n.endswith("weight.bin") else data)
    with pytest.raises(ValueError):
        coreml.describe(out.getvalue())


@pytest.mark.slow  # ~45 s of conversion
def test_a_bundle_ships_the_packages_and_runs_here_on_their_eager_fallback(cache, tmp_path):
    bundle = tmp_path / "gpt2.bundle"
    _compile("GPT2LMHeadModel", bundle, "--targets", "coreml")
    _, inputs, expected = _eager("GPT2LMHeadModel")
    _close(_fresh_run(bundle, inputs, tmp_path), expected)
    manifest = json.loads((bundle / "manifest.json").read_text())
    parts = [p for g in manifest["methods"]["forward"]["programs"] for p in g["partitions"] if p["delegate"] == "coreml"]
    assert parts and all(p["artifact"].endswith(".mlpackage.zip") and "fallback" in p for p in parts)
    for p in parts:
        assert coreml.describe((bundle / p["artifact"]).read_bytes())["ops"]
    loaded = torchnative.load(bundle)
    assert len(loaded.fallbacks) == (0 if ON_MAC else len(parts))
    assert all("macOS and iOS only" in why for _, _, why in loaded.fallbacks)


@pytest.mark.slow  # ~35 s of conversion; the bundle test above converts by default
def test_a_generating_bundle_keeps_the_kv_cache_as_core_ml_states(cache, tmp_path):
    """Prefill and decode over one static cache: every cache write is a Core ML state (iOS 18
    StateType) of a package, and the bundle generates eager's tokens here on the fallbacks."""
    model = models.transformers_model("GPT2LMHeadModel", "tiny", use_cache=True)
    save(compile_generation(model, ["coreml"], cache_len=32, prefill_len=8), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    manifest = loaded.manifest
    declared = {s["name"]: s["shape"] for s in manifest["state"] if ".keys" in s["name"] or ".values" in s["name"]}
    for name, m in manifest["methods"].items():
        parts = [p for g in m["programs"] for p in g["partitions"] if p["delegate"] == "coreml"]
        states = [s for p in parts for s in coreml.describe((tmp_path / "b" / p["artifact"]).read_bytes())["states"]]
        # each layer's keys and values, at the cache's shape
        assert sorted(s["shape"] for s in states) == sorted(declared.values()), name
    prompt = torch.randint(0, 1000, (1, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(loaded.generate(prompt, max_new_tokens=12), model.generate(prompt, max_new_tokens=12, do_sample=False))


@pytest.mark.slow  # ~50 s of conversion
def test_a_sliding_window_bundle_keeps_its_rings_as_core_ml_states_in_decode(cache, tmp_path):
    """Gemma 3's five local layers to a global one: decode's package holds every ring (the
    window's slots) and the global layer's cache as states; tokens past the window are eager's."""
    from tests.test_bundle_generate import LONG, WINDOW, _sliding

    model = _sliding("Gemma3ForCausalLM", tmp_path)[1]
    save(compile_generation(model, ["coreml"], cache_len=48, prefill_len=8), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    declared = sorted(s["shape"] for s in loaded.manifest["state"])
    assert declared.count([1, 2, WINDOW, 16]) == 10 and declared.count([1, 2, 48, 16]) == 2
    parts = [p for g in loaded.manifest["methods"]["decode"]["programs"] for p in g["partitions"] if p["delegate"] == "coreml"]
    states = [s["shape"] for p in parts for s in coreml.describe((tmp_path / "b" / p["artifact"]).read_bytes())["states"]]
    assert sorted(states) == declared
    with torch.no_grad():
        assert torch.equal(loaded.generate(LONG, max_new_tokens=24), model.generate(LONG, max_new_tokens=24, do_sample=False))


def test_writes_at_several_positions_are_indexed_in_full():
    """A prefill's `cache[:, :, positions] = kv` rewritten for coremltools computes the same."""
    state, kv, positions = torch.randn(2, 3, 16, 4), torch.randn(2, 3, 5, 4), torch.tensor([4, 5, 6, 7, 8])
    g = fx.Graph()
    s, v, i = g.placeholder("s"), g.placeholder("v"), g.placeholder("i")
    for node, t in ((s, state), (v, kv), (i, positions)):
        node.meta["val"] = t
    g.output([g.call_function(torch.ops.aten.index_put.default, (s, [None, None, i], v))])
    graph = CapturedGraph(fx.GraphModule(torch.nn.Module(), g), ["input"] * 3, ["output"])
    rewritten = coreml._indexed_in_full(graph)
    assert all(None not in n.args[1] for n in rewritten.gm.graph.nodes if n.target is torch.ops.aten.index_put.default)
    assert torch.equal(rewritten.gm(state, kv, positions)[0], graph.gm(state, kv, positions)[0])


@pytest.mark.skipif(not ON_MAC, reason="Core ML predicts on macOS and iOS only; this machine is "
                                       f"{platform.system()} {platform.machine()}")
def test_partitions_execute_on_macos():
    model = models.build("bert")
    inputs = models.example_inputs("bert", model)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        with torchnative.capture(["coreml"], compile_after=1):
            e = torchnative.explain(model, **inputs)
    assert any(d == "coreml" for parts in e.partitions for d, _ in parts)
    torch.testing.assert_close(e.output.last_hidden_state, expected, rtol=2e-2, atol=2e-2)


def test_masked_attention_converts_with_its_masked_rows_written_out(cache):
    """Core ML's attention is a plain softmax (NaN where a mask hides every key; eager gives 0):
    the package computes which rows are hidden (reduce_max, equal) and selects 0 for them."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 4, 8, generator=g) for _ in range(3))
    mask = torch.rand(2, 1, 4, 4, generator=g) > 0.3
    with torch.no_grad(), record(events.PartitionCompiled) as compiled, torchnative.capture(["coreml"], compile_after=1):
        y = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 2
        y.sum().item()
    (graph,) = [e.step.graph for e in compiled if "scaled_dot_product" in str(e.step.graph.gm.graph)]
    ops = coreml.CoreML().compile(graph).meta["ops"]
    assert ops.get("scaled_dot_product_attention") == 1 and ops.get("equal") and ops.get("select"), ops


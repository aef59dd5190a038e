"""The `coreai` delegate (Apple Core AI through coreai-torch), executed here on coreai-core's
reference runtime: generating bundles whose KV caches and sliding-window rings are Core AI
states, against eager's tokens. Its op table, models and edge cases are tests/test_delegates.py's
(it executes, so it is in EXECUTING)."""
import pathlib
import tempfile

import pytest
import torch
import torch.fx as fx

import torchnative
from tests.test_bundle_generate import LONG, SLIDING_CACHE, WINDOW, _sliding
from torchnative.bundle.build import compile_generation
from torchnative.bundle.save import save
from torchnative.delegates import REGISTRY
from torchnative.delegates.coreml import unpack

pytest.importorskip("coreai_torch")


def _function_states(bundle: pathlib.Path, method: str) -> list[list[int]]:
    """The shapes of the states of each Core AI asset of a method, as the assets declare them."""
    from coreai.authoring import AIModelAsset

    manifest = torchnative.load(bundle).manifest
    shapes = []
    for part in (p for g in manifest["methods"][method]["programs"] for p in g["partitions"]):
        assert part["delegate"] == "coreai", part["delegate"]
        with tempfile.TemporaryDirectory() as tmp:
            asset = AIModelAsset.load(unpack((bundle / part["artifact"]).read_bytes(), pathlib.Path(tmp), ".aimodel"))
            shapes += [[int(d) for d in desc.split("(")[1].split(",")[1].strip(" )").split(" × ")]
                       for _, desc in asset.summary().function_states("main")]
    return shapes


def test_it_executes_here_on_the_reference_runtime():
    status = torchnative.availability()["coreai"]
    assert status.status == "executes" and "reference runtime" in status.reason


def _check_sliding(arch: str, tmp_path: pathlib.Path) -> None:
    model = _sliding(arch, tmp_path)[1]
    save(compile_generation(model, ["coreai"], cache_len=SLIDING_CACHE, prefill_len=8), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    assert not loaded.fallbacks
    declared = sorted(s["shape"] for s in loaded.manifest["state"])
    assert sorted(_function_states(tmp_path / "b", "decode")) == declared  # every ring and cache a state in decode
    assert [1, 2, WINDOW, 16] in declared
    with torch.no_grad():
        assert torch.equal(loaded.generate(LONG, max_new_tokens=48), model.generate(LONG, max_new_tokens=48, do_sample=False))


def test_a_sliding_window_bundle_keeps_its_rings_as_core_ai_states(tmp_path):
    """Mistral, all layers sliding: one asset per method, the rings its states, tokens past the
    window eager's."""
    _check_sliding("MistralForCausalLM", tmp_path)


@pytest.mark.slow  # ~20 s of conversion
def test_gemma3s_mixed_layers_in_one_core_ai_bundle(tmp_path):
    _check_sliding("Gemma3ForCausalLM", tmp_path)


def test_a_reduction_of_a_0d_tensor_is_refused_not_converted():
    """coreai-torch 0.4.3 aborts the process (a native assertion) converting mean or sum of a 0-d
    tensor: the delegate says no without asking it."""
    g = fx.Graph()
    x = g.placeholder("x")
    x.meta["val"] = torch.randn(())
    mean = g.call_function(torch.ops.aten.mean.default, (x,))
    mean.meta["val"] = torch.randn(())
    g.output([mean])
    verdict = REGISTRY["coreai"].supports(mean)
    assert not verdict and "aborts the process" in verdict.reason

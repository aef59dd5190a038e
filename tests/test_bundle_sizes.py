"""Bundles that take a range of sizes (`capture-and-compile --dynamic`, bundle/dynamic.py): the
call captured at three sizes, each graph compiled once for every size n of the range; a loaded
bundle runs any n in it, in a fresh process too, equal to eager; n out of the range, dims that
should share n and do not, a range wider than the model takes, and a call whose sizes follow no
rule are refused with what to do."""
import json

import pytest
import torch

import torchnative
from tests.test_bundle import _fresh_run
from torchnative import cli, models
from torchnative.bundle import BundleError
from torchnative.bundle.build import compile_call
from torchnative.bundle.dynamic import parse
from torchnative.bundle.save import save

DIMS = "input_ids:1,attention_mask:1"


def _inputs(n: int) -> dict:
    g = torch.Generator().manual_seed(n)
    return {"input_ids": torch.randint(0, 1000, (1, n), generator=g), "attention_mask": torch.ones(1, n, dtype=torch.long)}


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    out = tmp_path_factory.mktemp("sized") / "bert.bundle"
    assert cli.main(["capture-and-compile", "transformers:BertModel", "--dynamic", f"{DIMS}=2..512", "--out", str(out)]) == 0
    return out


def test_a_bundle_runs_every_size_of_its_range_in_a_fresh_process(bert, tmp_path):
    model = models.transformers_model("BertModel", "tiny")
    manifest = json.loads((bert / "manifest.json").read_text())
    forward = manifest["methods"]["forward"]
    assert manifest["schema"] == 3 and forward["size"]["range"] == [2, 512]
    assert [i["shape"] for i in forward["inputs"]] == [[1, "n"], [1, "n"]]
    assert len(forward["programs"]) == 2  # the embeddings and the mask's check, then the encoder: each compiled once
    for n in (2, 37, 300):
        with torch.no_grad():
            expected = model(**_inputs(n)).last_hidden_state
        got = _fresh_run(bert, _inputs(n), tmp_path)["last_hidden_state"]
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


def test_sizes_out_of_the_range_or_apart_are_refused(bert):
    loaded = torchnative.load(bert)
    with pytest.raises(BundleError, match=r"n = 600 \(input_ids:1, attention_mask:1\) is out of this bundle's range 2..512"):
        loaded(**_inputs(600))
    with pytest.raises(BundleError, match=r"share one size n in forward; got \{'input_ids:1': 6, 'attention_mask:1': 7\}"):
        loaded(input_ids=torch.zeros(1, 6, dtype=torch.long), attention_mask=torch.ones(1, 7, dtype=torch.long))
    with pytest.raises(BundleError, match=r"'input_ids' must be int64\[1, n\] with n 2..512, got int64\[2, 6\]"):
        loaded(input_ids=torch.zeros(2, 6, dtype=torch.long), attention_mask=torch.ones(1, 6, dtype=torch.long))


def test_a_range_wider_than_the_model_takes_is_refused_with_what_it_takes(tmp_path):
    model = models.transformers_model("BertModel", "tiny")
    with pytest.raises(BundleError, match=rf"takes n from 2 to 512 only .* use --dynamic {DIMS}=2..512"):
        compile_call(model, _inputs(16), ["ort"], dynamic=parse(f"{DIMS}=2..1024"))


@pytest.mark.parametrize("target", ["ort", "xnnpack", pytest.param("coreai", marks=pytest.mark.slow)])  # coreai: ~14 s
def test_a_view_of_a_graph_value_follows_n(tmp_path, target):
    """GPT-2's logits are a view Python took of the LM head's output: its sizes follow n too.
    XNNPACK's programs (ExecuTorch plans memory for the largest size) are built for the range's high;
    Core AI's functions have a `?` dim."""
    if target == "coreai":
        pytest.importorskip("coreai_torch")
    model = models.transformers_model("GPT2LMHeadModel", "tiny")
    method = compile_call(model, _inputs(8), [target], dynamic=parse(f"{DIMS}=2..200"))
    steps = [step for s in method.methods["forward"].trace.calls for step in s.program.steps]
    assert target in {step.delegate for step in steps}
    if target == "xnnpack":
        artifacts = [step.artifact for s in method.methods["forward"].trace.calls for step in s.program.steps
                     if step.delegate == "xnnpack"]
        assert artifacts and all(a.bounds[0] == (2, 200) for a in artifacts if a.bounds)
        assert any(a.bounds for a in artifacts)  # partitions whose sizes follow n
    save(method, tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    for n in (3, 64, 200):
        with torch.no_grad():
            torch.testing.assert_close(loaded(**_inputs(n))["logits"], model(**_inputs(n)).logits, rtol=1e-4, atol=1e-5)


class _Quadratic(torch.nn.Module):
    def forward(self, x):
        return x.flatten()[: x.shape[1] ** 2] * 2


def test_sizes_that_follow_no_rule_are_refused():
    with pytest.raises(BundleError, match=r"sizes no rule a\*n \+ c gives"):
        compile_call(_Quadratic(), {"x": torch.randn(1, 8, 8)}, ["ort"], dynamic=parse("x:1=2..8"))


@pytest.mark.parametrize("spec, message", [("input_ids=2..9", "expected NAME:DIM"), ("input_ids:1=1..9", "start at 2"),
                                           ("input_ids:1=5..6", "three sizes")])
def test_a_malformed_range_is_refused(spec, message):
    with pytest.raises(BundleError, match=message):
        parse(spec)


@pytest.fixture(scope="module")
def bucketed(tmp_path_factory):
    """BERT for IREE's CPU backend, which compiles static shapes: the range as buckets."""
    out = tmp_path_factory.mktemp("buckets") / "bert.bundle"
    model = models.transformers_model("BertModel", "tiny")
    save(compile_call(model, _inputs(8), ["iree-cpu"], dynamic=parse(f"{DIMS}=2..40")), out, "test")
    return out, model


def test_static_targets_run_a_range_as_padded_buckets(bucketed, tmp_path):
    bundle, model = bucketed
    manifest = json.loads((bundle / "manifest.json").read_text())
    forward = manifest["methods"]["forward"]
    assert manifest["schema"] == 4
    assert [(b["n"], b["padded"]) for b in forward["buckets"]] == [(16, True), (32, True), (40, True), (40, False)]
    assert forward["outputs"] == [{"name": "last_hidden_state", "slice": [[1, "n"]]}, {"name": "pooler_output", "slice": []}]
    loaded = torchnative.load(bundle)
    assert list(loaded.methods) == ["forward"] and not loaded.fallbacks  # every bucket's partitions run on IREE
    # the edges of each bucket: padded up to it, its own size (the next bucket), the top (unpadded)
    for n in (2, 15, 16, 17, 32, 39, 40):
        with torch.no_grad():
            expected = model(**_inputs(n))
        got = loaded(**_inputs(n))
        assert got["last_hidden_state"].shape == (1, n, 64)
        torch.testing.assert_close(got["last_hidden_state"], expected.last_hidden_state, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got["pooler_output"], expected.pooler_output, rtol=1e-4, atol=1e-5)
    got = _fresh_run(bundle, _inputs(23), tmp_path)
    with torch.no_grad():
        torch.testing.assert_close(got["last_hidden_state"], model(**_inputs(23)).last_hidden_state, rtol=1e-4, atol=1e-5)
    with pytest.raises(BundleError, match=r"n = 41 .* is out of this bundle's range 2..40"):
        loaded(**_inputs(41))


class _Unmasked(torch.nn.Module):
    """Takes a mask and ignores it: every position's output mixes all positions, padding too."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(1000, 8)

    def forward(self, input_ids, attention_mask):
        h = self.embed(input_ids)
        return h + h.mean(1, keepdim=True)


def test_buckets_refuse_a_model_that_does_not_mask_the_padding():
    with pytest.raises(BundleError, match=r"padding n = 2 to 16 changes output 'output' .* does not mask the padded"):
        compile_call(_Unmasked(), _inputs(8), ["iree-cpu"], dynamic=parse(f"{DIMS}=2..40"))
    with pytest.raises(BundleError, match=r"--dynamic names no attention_mask dim"):
        compile_call(_Unmasked(), _inputs(8), ["iree-cpu"], dynamic=parse("input_ids:1=2..40"))


def test_a_bucket_the_manifest_lacks_is_refused(bucketed, tmp_path):
    import shutil

    bundle, _ = bucketed
    damaged = tmp_path / "damaged.bundle"
    shutil.copytree(bundle, damaged)
    manifest = json.loads((damaged / "manifest.json").read_text())
    del manifest["methods"]["forward_32"]
    (damaged / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(BundleError, match=r"runs as buckets \['forward_32'\] that the manifest does not hold"):
        torchnative.load(damaged)

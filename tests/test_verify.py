"""Every compiled partition is checked before it is trusted (issue 38, build/verify.py): a
delegate partition beyond its delegate's tolerance on the build inputs runs on eager, declined with
the numbers; the program's results are eager's; what the graph leaves undefined is not a gap."""
import dataclasses
import math

import pytest
import torch

import torchnative
from tests.conftest import record
from tests.test_numeric_gap import _PlusOne, _mlp
from torchnative import events, store
from torchnative.build.verify import gap
from torchnative.cache.program_cache import clear_caches, programs
from torchnative.delegates import REGISTRY


@pytest.fixture(autouse=True)
def fresh(monkeypatch):
    clear_caches()
    torchnative.reset_stats()
    monkeypatch.setattr("torchnative.build.verify._warned", set())  # each test sees its warning once


def test_a_wrong_partition_is_declined_at_build_and_the_result_is_eager_s(monkeypatch):
    monkeypatch.setitem(REGISTRY, _PlusOne.name, _PlusOne())
    model, x = _mlp(), torch.randn(4, 16)
    with torch.no_grad():
        expected = model(x)
        with record(events.Fallback) as fallbacks, pytest.warns(UserWarning, match="plus-one partition .* runs on eager"):
            with torchnative.capture(["plus-one", "ort"], compile_after=1):
                got = model(x)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    (program,) = programs()
    assert [s.delegate for s in program.steps] == ["ort", "eager", "ort"]
    wrong = program.steps[1].verdict
    assert not wrong.ok and wrong.gap > 0.01
    assert all(s.verdict.ok and s.verdict.gap < 1e-5 for s in (program.steps[0], program.steps[2]))
    (f,) = fallbacks
    assert f.delegate == "plus-one" and "verify:" in f.reason and "off eager" in f.reason and "tolerance 0.0001" in f.reason
    assert any(k.startswith("plus-one: verify:") for k in torchnative.stats()["fallbacks"])


class _OrtPlusOne(_PlusOne):
    """ONNX Runtime's relu, + 1: a wrong delegate whose artifacts the disk cache keeps."""
    name = "ort-plus-one"
    ort = REGISTRY["ort"]
    toolchain, external_weights = ort.toolchain, ort.external_weights

    def compile(self, graph):
        return dataclasses.replace(self.ort.compile(graph), delegate=self.name)

    def load(self, artifact):
        run = self.ort.load(artifact)
        return lambda inputs: [o + 1 for o in run(inputs)]


def test_a_verdict_is_kept_with_its_disk_cache_entry(monkeypatch, tmp_path):
    """A second process (here: the in-memory caches cleared) takes the artifact and its verdict from
    the disk cache: the wrong partition is declined again without an eager run."""
    monkeypatch.setitem(REGISTRY, _OrtPlusOne.name, _OrtPlusOne())
    monkeypatch.setattr(store, "_place", store._open(tmp_path))
    model, x = _mlp(), torch.randn(4, 16)

    def build() -> list:
        clear_caches()
        with torch.no_grad(), torchnative.capture(["ort-plus-one", "ort"], compile_after=1):
            y = model(x)
        torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-6)
        (program,) = programs()
        return program.steps

    first = build()
    assert len(list(tmp_path.glob("*.verdict"))) == 3
    monkeypatch.setattr("torchnative.build.pipeline.reference", lambda *a: pytest.fail("checked again"))
    second = build()
    assert [s.delegate for s in second] == ["ort", "eager", "ort"]
    assert [(s.verdict.ok, s.verdict.gap) for s in second] == [(s.verdict.ok, s.verdict.gap) for s in first]


def test_the_check_can_be_turned_off(monkeypatch):
    monkeypatch.setitem(REGISTRY, _PlusOne.name, _PlusOne())
    monkeypatch.setattr("torchnative.build.verify.ENABLED", True)  # restored after the test
    with pytest.warns(UserWarning, match="check of delegate partitions against eager is off"):
        torchnative.set_verify(False)
    model, x = _mlp(), torch.randn(4, 16)
    with torch.no_grad(), torchnative.capture(["plus-one", "ort"], compile_after=1):
        y = model(x)  # held: a result nobody holds is never computed
    (program,) = programs()
    assert [s.delegate for s in program.steps] == ["ort", "plus-one", "ort"] and program.verify_s == 0.0
    assert (y - model(x)).abs().max() > 0.1  # the wrong partition ran, as asked


def test_memory_a_graph_leaves_undefined_is_not_a_gap():
    """A buffer made with torch.empty and only partly written: its other elements are whatever
    memory held, on eager and on the delegate alike; only the written ones are compared."""
    def fill(x):
        out = torch.empty(4, 8)
        out[:, :4] = x.tanh()
        return out * 2

    x = torch.randn(4, 4)
    with torch.no_grad(), record(events.Fallback) as fallbacks, torchnative.capture(["ort"], compile_after=1):
        y = fill(x)
    torch.testing.assert_close(y[:, :4], fill(x)[:, :4])
    assert not fallbacks, [f.reason for f in fallbacks]
    steps = [s for p in programs() for s in p.steps if s.delegate == "ort"]
    assert steps and all(s.verdict.ok for s in steps)


def test_gaps_measure_what_they_say():
    t = torch.tensor
    assert gap(t([1.0, math.inf, math.nan]), t([1.0, math.inf, math.nan])) == 0.0
    assert gap(t([1.0, 2.0]), t([1.0, 4.0])) == 0.5  # scale: the largest error over the largest magnitude
    assert gap(t([3.0, 4.0]), t([3.0, 0.0]), "l2") == pytest.approx(4 / 3)
    assert gap(t([math.nan]), t([1.0])) == math.inf and gap(t([1.0, 2.0]), t([1.0])) == math.inf
    assert gap(t([1.0, 99.0]), t([1.0, 2.0]), defined=t([True, False])) == 0.0
    # a value that cancelled to ~0 is measured against a floor of 1e-3, not its own noise
    assert gap(t([1.5e-8, 0.0]), t([1.1e-8, 0.0])) == pytest.approx(4e-6, rel=1e-3)
    assert gap(t([2e-3]), t([1e-3])) == pytest.approx(1.0)
    assert gap(t([3]), t([1])) == 2 / 1  # integers: no floor


def test_verification_runs_on_every_compiled_model_partition_without_false_alarms():
    """GPT-2 and BERT (tiny) on ort: every partition checked, none declined."""
    from torchnative import models
    for name in ("gpt2", "bert"):
        model = models.build(name)
        model.config.use_cache = False
        inputs = models.example_inputs(name, model, batch=2)
        with torch.no_grad(), record(events.Fallback) as fallbacks, torchnative.capture(["ort"], compile_after=1):
            out = model(**inputs)
        assert out is not None and not fallbacks, [f.reason for f in fallbacks]
    checked = [s for p in programs() for s in p.steps if s.verdict is not None]
    assert checked and all(s.verdict.ok for s in checked)


def _float64_steps(f, *args) -> tuple[torch.Tensor, dict]:
    clear_caches()
    torchnative.reset_stats()
    for _ in range(3):
        with torchnative.capture(delegates=["ort"]):
            out = f(*args)
        out = out + 0
    return out, torchnative.stats()


def test_a_float64_partition_is_held_to_float64_precision():
    """Float64 throughout, a partition is checked against 1e-10 of its scale, not float32's 1e-4:
    torchlib rounds a Python float constant to float32 (GPT-2's `x * 0.7978845608028654`: 4e-9
    off), which float32's bound let through. Such a partition runs on eager, exactly."""
    x = torch.randn(4, 16, dtype=torch.float64)
    f = lambda x: torch.tanh(x * 0.7978845608028654) * 0.5  # noqa: E731
    out, stats = _float64_steps(f, x)
    assert torch.equal(out, f(x))
    assert any("verify:" in k and "float64 kernels" in k for k in stats["fallbacks"])


def test_float64_attention_and_gelu_on_ort():
    """Attention's constants (its scale, the masked score) are made in the inputs' dtype: float32
    ones failed ONNX Runtime's type check for float64 inputs ("bound to different types"). GELU
    and erf in float64 stay on eager, declined with the reason: no float64 Erf kernel, and the tanh
    form's constants rounded to float32."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 9, 32, dtype=torch.float64) for _ in range(3))
    mask = torch.ones(9, 9, dtype=torch.bool).tril()
    attend = lambda q, k, v: torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 1.5  # noqa: E731
    out, stats = _float64_steps(attend, q, k, v)
    assert not stats["fallbacks"] and (out - attend(q, k, v)).abs().max() < 1e-12
    for approximate in ("none", "tanh"):
        gelu = lambda x: torch.nn.functional.gelu(x * 2, approximate=approximate) + 1  # noqa: E731
        explained = torchnative.explain(gelu, q)
        assert torch.equal(explained.output, gelu(q))
        assert any("float64 GELU" in why for p in explained.programs for _, _, why in p.declined)

"""transformers models from small configs under `accelerate`: outputs, generate, gradients."""
import copy

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative import models

pytest.importorskip("transformers")


@pytest.mark.parametrize("name", sorted(models.BUILDERS))
def test_forward_equals_eager(name):
    model = models.build(name)
    inputs = models.example_inputs(name, model, batch=2)
    with torch.no_grad():
        ref = model(**inputs)
        torchnative.accelerate(model)  # the default delegates
        calls = [model(**inputs) for _ in range(4)]  # eager, compiled, then replayed where eligible
    key = "logits" if "logits" in ref else "last_hidden_state"
    for out in calls:
        assert type(out[key]) is torch.Tensor
        assert_same(out[key], ref[key], rtol=1e-4, atol=1e-5)
    torchnative.deaccelerate(model)
    assert "forward" not in model.__dict__


def test_accelerate_is_idempotent():
    model = models.build("bert")
    torchnative.accelerate(model)
    forward = model.forward
    assert torchnative.accelerate(model).forward is forward


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("cache", ["dynamic", "static"])
def test_generate_same_tokens(name, cache):
    model = models.build(name)
    ids = models.example_inputs(name, model, seq=8)["input_ids"]
    kwargs = dict(max_new_tokens=16, do_sample=False, pad_token_id=0)
    if cache == "static":
        kwargs["cache_implementation"] = "static"
    ref = model.generate(ids, **kwargs)
    torchnative.accelerate(model)
    torchnative.reset_stats()
    out = model.generate(ids, **kwargs)
    assert torch.equal(out, ref)
    assert torchnative.stats()["ops_recorded"] > 0


def test_gradients_through_captured_gpt2():
    model = models.build("gpt2").train()
    model.config.attn_implementation = "sdpa"
    for m in model.modules():  # dropout off so both runs draw nothing at random
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
    twin = copy.deepcopy(model)
    ids = models.example_inputs("gpt2", model, batch=2)["input_ids"]
    model(ids, labels=ids).loss.backward()
    torchnative.accelerate(twin)
    loss = twin(ids, labels=ids).loss
    loss.backward()
    for (n, p), (_, q) in zip(model.named_parameters(), twin.named_parameters()):
        assert q.grad is not None, n
        assert_same(q.grad, p.grad, rtol=1e-4, atol=1e-5)

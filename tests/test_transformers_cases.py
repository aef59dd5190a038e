"""The cases transformers' own model tests exercise, accelerated, against eager: padded batches
(left and right), masked rows, position_ids given or not, encoder padding, a cache that holds
caches, attentions and hidden states returned, generation strategies, torch.compile over an
accelerated model, every model called a few times at new shapes. Each on `eager` and `ort`,
compiled path included (a graph compiles on its second run)."""
import copy

import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative import models

pytest.importorskip("transformers")

DELEGATES = ["eager", "ort"]
CAUSAL = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM",
          "mistral": "MistralForCausalLM"}


def _causal(name: str) -> torch.nn.Module:
    model = models.transformers_model(CAUSAL[name], use_cache=True)
    model.generation_config.pad_token_id = 0
    return model


def _left_padded(batch: int = 2, seq: int = 9, pads: tuple = (3, 0), seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Prompts as transformers batches them: row r left-padded by pads[r] tokens (id 0, mask 0)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(1, 1000, (batch, seq), generator=g)
    mask = torch.ones_like(ids)
    for r, n in enumerate(pads):
        ids[r, :n], mask[r, :n] = 0, 0
    return ids, mask


# on ort, Qwen2 and Mistral (Llama's attention again, ~18 s each) run with -m slow
@pytest.mark.parametrize("name, delegate", [(n, d) if d == "eager" or n in ("gpt2", "llama") else
                                            pytest.param(n, d, marks=pytest.mark.slow)
                                            for n in sorted(CAUSAL) for d in DELEGATES])
def test_left_padded_batched_generate_equals_eager(name, delegate):
    """A padded position's query sees no key: eager's attention gives 0 there, a plain softmax NaN
    (that NaN once turned a padded row's tokens into 0 0 0 0 0 from the first compiled call)."""
    model = _causal(name)
    prompts = [_left_padded(seq=9, pads=(3, 0)), _left_padded(seq=12, pads=(0, 5), seed=1), _left_padded(seq=9, pads=(3, 0))]
    kwargs = dict(max_new_tokens=5, do_sample=False)
    expected = [model.generate(input_ids=ids, attention_mask=mask, **kwargs) for ids, mask in prompts]
    torchnative.accelerate(model, delegates=[delegate])
    torchnative.reset_stats()
    try:
        for (ids, mask), ref in zip(prompts, expected):
            assert torch.equal(model.generate(input_ids=ids, attention_mask=mask, **kwargs), ref)
    finally:
        torchnative.deaccelerate(model)
    assert torchnative.stats()["graph_runs"] > 0  # compiled programs ran (built here, or by a model of the same graphs)


@pytest.mark.parametrize("delegate", DELEGATES)
def test_position_ids_given_or_not_equal_eager(delegate):
    """Llama over a left-padded batch, three calls each way: position_ids derived by the model,
    and given as generate() derives them (counting from each row's first real token)."""
    model = _causal("llama")
    ids, mask = _left_padded(seq=10, pads=(4, 0))
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        expected = [model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                    model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits]
        torchnative.accelerate(model, delegates=[delegate])
        try:
            for _ in range(3):
                got = [model(input_ids=ids, attention_mask=mask, use_cache=False).logits,
                       model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=False).logits]
                for g, e in zip(got, expected):
                    assert not g.isnan().any()
                    assert_same(g, e, rtol=1e-4, atol=1e-5)
        finally:
            torchnative.deaccelerate(model)


@pytest.mark.parametrize("delegate", DELEGATES)
def test_right_padded_batches_at_new_shapes_equal_eager(delegate):
    """BERT as its tests call it: batches of new lengths, right-padded, hidden states and
    attentions returned; every real position's values equal eager's (transformers leaves the
    padded positions' values unspecified, but eager's are what a user compares with)."""
    model = models.build("bert")
    model.config.use_cache = False
    calls = []
    for batch, seq, pad in [(2, 7, 3), (3, 11, 5), (2, 7, 3), (2, 16, 1), (2, 7, 3)]:
        ids, mask = _left_padded(batch, seq, (0,) * batch)
        mask[0, seq - pad:] = 0
        calls.append(dict(input_ids=ids, attention_mask=mask, output_hidden_states=True))
    with torch.no_grad():
        expected = [model(**c) for c in calls]
        torchnative.accelerate(model, delegates=[delegate])
        try:
            got = [model(**c) for c in calls]
        finally:
            torchnative.deaccelerate(model)
    for g, e in zip(got, expected):
        assert_same(g.last_hidden_state, e.last_hidden_state, rtol=1e-4, atol=1e-5)
        assert_same(g.hidden_states, e.hidden_states, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("delegate", DELEGATES)
def test_output_attentions_and_hidden_states_equal_eager(delegate):
    model = models.transformers_model("GPT2LMHeadModel", use_cache=False)
    model.config._attn_implementation = "eager"  # the attention implementation that returns weights
    ids, mask = _left_padded(seq=8, pads=(2, 0))
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
        torchnative.accelerate(model, delegates=[delegate])
        try:
            calls = [model(input_ids=ids, attention_mask=mask, output_attentions=True, output_hidden_states=True)
                     for _ in range(3)]
        finally:
            torchnative.deaccelerate(model)
    for got in calls:
        assert len(got.attentions) == len(expected.attentions) and len(got.hidden_states) == len(expected.hidden_states)
        assert_same(got.attentions, expected.attentions, rtol=1e-4, atol=1e-5)
        assert_same(got.hidden_states, expected.hidden_states, rtol=1e-4, atol=1e-5)
        assert_same(got.logits, expected.logits, rtol=1e-4, atol=1e-5)


STRATEGIES = {"greedy": dict(do_sample=False), "beam": dict(num_beams=3, do_sample=False),
              "sample": dict(do_sample=True, top_k=8, temperature=0.9)}


def _generations(model: torch.nn.Module, calls: list[dict]) -> list[torch.Tensor]:
    out = []
    for c in calls:
        torch.manual_seed(7)  # sampling draws the same numbers: any difference is the logits'
        out.append(model.generate(**c))
    return out


# on ort (~21 s, ~38 s below) with -m slow: the eager delegate checks the same replays by default
@pytest.mark.parametrize("delegate", [d if d == "eager" else pytest.param(d, marks=pytest.mark.slow) for d in DELEGATES])
def test_encoder_decoder_generate_with_padded_encoder_equals_eager(delegate):
    """T5's decode calls take an EncoderDecoderCache, a cache object holding two caches (the tracer
    once failed on it with KeyError: 1), and attend over an encoder batch with padding."""
    model = models.transformers_model("T5ForConditionalGeneration", use_cache=True)
    ids, mask = _left_padded(seq=8, pads=(0, 0))
    mask[1, 5:] = 0
    calls = [dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, **kw) for kw in STRATEGIES.values()] * 2
    expected = _generations(model, calls)
    torchnative.accelerate(model, delegates=[delegate])
    torchnative.reset_stats()
    try:
        got = _generations(model, calls)
    finally:
        torchnative.deaccelerate(model)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)
    assert torchnative.stats()["replays"] > 0  # the cache inside the cache is read where it sits


@pytest.mark.parametrize("delegate", [d if d == "eager" else pytest.param(d, marks=pytest.mark.slow) for d in DELEGATES])
def test_generation_strategies_equal_eager(delegate):
    """Greedy, beam search, sampling under a fixed seed, and assisted decoding (a draft model whose
    tokens the accelerated model verifies) on a left-padded batch, each twice. Contrastive search
    is not here: transformers 5 loads it from the Hub (trust_remote_code), which no test may do."""
    model = _causal("gpt2")
    draft = models.transformers_model("GPT2LMHeadModel", seed=1, use_cache=True)
    ids, mask = _left_padded(seq=8, pads=(2, 0))
    calls = [dict(input_ids=ids, attention_mask=mask, max_new_tokens=6, **kw) for kw in STRATEGIES.values()]
    calls.append(dict(input_ids=ids[1:], attention_mask=mask[1:], max_new_tokens=6, do_sample=False, assistant_model=draft))
    calls *= 2
    expected = _generations(model, calls)
    torchnative.accelerate(model, delegates=[delegate])
    try:
        got = _generations(model, calls)
    finally:
        torchnative.deaccelerate(model)
    for g, e in zip(got, expected):
        assert torch.equal(g, e)


def test_torch_compile_over_an_accelerated_model_is_one_opaque_call():
    """Dynamo sees the accelerated forward as one call it does not trace: no graph of its own, no
    recompile per call (it recompiled on every call: 41 graphs over 4 identical calls), and
    torchnative's programs still run."""
    import torch._dynamo.utils as dynamo_utils

    torch._dynamo.reset()
    graphs_before = dynamo_utils.counters["stats"]["unique_graphs"]
    model = models.build("gpt2")
    ids = models.example_inputs("gpt2", model, batch=2, seq=8)["input_ids"]
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        compiled = torch.compile(torchnative.accelerate(model, delegates=["ort"]))
        torchnative.reset_stats()
        try:
            got = [compiled(ids, use_cache=False).logits for _ in range(4)]
        finally:
            torchnative.deaccelerate(model)
    for g in got:
        assert_same(g, expected, rtol=1e-4, atol=1e-5)
    assert dynamo_utils.counters["stats"]["unique_graphs"] == graphs_before
    assert torchnative.stats()["graphs_built"] >= 1 and torchnative.stats()["replays"] >= 1


@pytest.mark.parametrize("delegate", DELEGATES)
def test_every_model_called_at_new_shapes_equals_eager(delegate):
    """As a test suite calls a model: a few calls, each at a new batch and length, outputs equal to
    eager's on each; a deep copy made after accelerate gives its own results."""
    # ort compiles each model's graphs at every new shape (templates from the third): two models
    for name in ("gpt2", "llama", "bert", "vit") if delegate == "eager" else ("gpt2", "bert"):
        model = models.build(name)
        model.config.use_cache = False
        shapes = [(1, 5), (2, 9), (3, 6), (2, 9)] if name != "vit" else [(1, None), (3, None), (2, None), (3, None)]
        inputs = [models.example_inputs(name, model, batch=b, seq=s or 16) for b, s in shapes]
        key = "last_hidden_state" if name in ("bert", "vit") else "logits"
        with torch.no_grad():
            expected = [model(**i)[key] for i in inputs]
            torchnative.accelerate(model, delegates=[delegate])
            twin = copy.deepcopy(model)
            try:
                for i, e in zip(inputs, expected):
                    assert_same(model(**i)[key], e, rtol=1e-4, atol=1e-5)
                    assert_same(twin(**i)[key], e, rtol=1e-4, atol=1e-5)
            finally:
                torchnative.deaccelerate(model)


@pytest.mark.parametrize("delegate", DELEGATES)
def test_calls_under_inference_mode_equal_eager(delegate):
    """`torch.inference_mode()` around every call (as inference servers write it), from the first
    call, after a weight changed (the call records again) and in generate(): recording in
    inference mode crashed on GPT-2's first op (a view of the input), on its cache's lazy
    `torch.tensor([])` and on a static cache's tensors, inference tensors, which have no version."""
    eager = _causal("gpt2")
    accelerated = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate])
    ids, mask = _left_padded()
    tol = dict(atol=0, rtol=0) if delegate == "eager" else dict(atol=1e-4, rtol=1e-4)
    torchnative.reset_stats()
    with torch.inference_mode():
        for i in range(4):
            if i == 2:
                for m in (eager, accelerated):
                    m.transformer.h[0].mlp.c_fc.weight.mul_(0.5)
            assert_same(accelerated(ids, attention_mask=mask).logits, eager(ids, attention_mask=mask).logits, **tol)
        kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
        assert torch.equal(accelerated.generate(ids, **kwargs), eager.generate(ids, **kwargs))
        # a static cache made in inference mode: its tensors, which the graphs write, have no version
        for _ in range(2):
            static = dict(max_new_tokens=6, do_sample=False, cache_implementation="static")
            assert torch.equal(accelerated.generate(ids[1:], **static), eager.generate(ids[1:], **static))
    assert torchnative.stats()["graph_runs"] > 0


@pytest.mark.parametrize("arch", ["gpt2", "llama", "bert"])
def test_inference_mode_records_the_graphs_no_grad_records(arch):
    """Composite ops reach the door whole in inference mode (no Autograd key decomposes them above
    it): dropout and attention, tagged random, cut GPT-2's call into 8 graphs there, BERT's into 9
    (1 or 2 under no_grad), and `if (mask == 0).any():` ran outside a graph, so no call replayed."""
    model = models.build(arch, "tiny")
    inputs = models.example_inputs(arch, model, seq=9)
    counts = {}
    for mode in (torch.no_grad, torch.inference_mode):
        with mode():
            explained = torchnative.explain(model, **inputs)
        counts[mode.__name__] = (len(explained.graphs), len(explained.breaks))
    assert counts["inference_mode"] == counts["no_grad"]
    accelerated = torchnative.accelerate(copy.deepcopy(model), compile_after=2)
    torchnative.reset_stats()
    with torch.inference_mode():
        for _ in range(5):
            out = accelerated(**inputs)
        expected = model(**inputs)
    assert_same(out[0], expected[0], atol=1e-5, rtol=1e-5)  # logits, or the last hidden state
    assert torchnative.stats()["replays"] >= 2 and not torchnative.stats()["replay_ineligible"]

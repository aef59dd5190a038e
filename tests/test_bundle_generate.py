"""Bundles that generate: a causal LM's prefill and decode methods over a static KV cache (the
bundle's state), `Bundle.generate` and `torchnative run --generate` in a fresh process, against
the eager model's `generate(do_sample=False)`; bad prompts, states and manifests refused."""
import json
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
from torchnative.bundle.build import compile_generation
from torchnative.bundle.save import save
from torchnative.passes.quantize import dequantized_copy

CACHE, PREFILL, NEW = 64, 8, 32
# a prompt of one prefill and three decode calls
PROMPT = torch.randint(0, 1000, (1, PREFILL + 3), generator=torch.Generator().manual_seed(3))


def _config(arch: str, tmp: Path) -> Path:
    """The tiny preset with larger initial weights: random models then pick varied tokens, not
    one token repeated, so a wrong cache position shows in the tokens."""
    config = models.transformers_model(arch, "tiny").config.to_dict()
    config["initializer_range"], config["initializer_factor"] = 0.2, 4.0  # (T5 reads the factor)
    path = tmp / f"{arch}.json"
    path.write_text(json.dumps(config))
    return path


def _eager(arch: str, config: Path, quantize: str | None = None, activations: bool = False) -> torch.Tensor:
    """Greedy tokens of eager; `quantize`: with the weights dequantized (and `activations`: the
    activations quantized as ort's low-bit kernels do)."""
    model = models.transformers_model(arch, str(config), use_cache=True)
    if quantize:
        model = dequantized_copy(model, quantize, activations)
    with torch.no_grad():
        return model.generate(PROMPT, max_new_tokens=NEW, do_sample=False)


def _bundle(arch: str, tmp: Path, *extra: str) -> tuple[Path, Path]:
    config = _config(arch, tmp)
    out = tmp / f"{arch}.bundle"
    # an encoder-decoder's prefill length is its encoder's: the longest prompt
    prefill = 2 * PREFILL if arch == "T5ForConditionalGeneration" else PREFILL
    assert cli.main(["capture-and-compile", f"transformers:{arch}", "--config", str(config), "--out", str(out),
                     "--cache-len", str(CACHE), "--prefill-len", str(prefill), *extra]) == 0
    return out, config


def _fresh_generate(bundle: Path, tmp: Path, prompt_tokens: bool = True, prompt: torch.Tensor = PROMPT,
                    new: int = NEW) -> torch.Tensor:
    """`torchnative run --generate` in a new process: its tokens (with the prompt's, as
    transformers returns them: a causal LM's after the prompt, an encoder-decoder's after the start)."""
    np.save(tmp / "prompt.npy", prompt.numpy())
    done = subprocess.run([sys.executable, "-m", "torchnative.cli", "run", str(bundle), "--generate", str(new),
                           "--input", f"input_ids={tmp / 'prompt.npy'}", "--save", str(tmp / "tokens.npz")],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "tokens/s (decode)" in done.stderr
    with np.load(tmp / "tokens.npz") as saved:
        tokens = torch.from_numpy(saved["tokens"])
    printed = tokens[0, prompt.shape[1] if prompt_tokens else 1:]
    assert done.stdout.split("\n")[0].split() == [str(t) for t in printed.tolist()]
    return tokens


# Qwen3 and Mistral (Llama's layout, ~6 s each) under -m slow
@pytest.mark.parametrize("arch", ["GPT2LMHeadModel", "LlamaForCausalLM", pytest.param("Qwen3ForCausalLM", marks=pytest.mark.slow),
                                  pytest.param("MistralForCausalLM", marks=pytest.mark.slow), "T5ForConditionalGeneration"])
def test_bundle_generates_in_a_fresh_process_the_tokens_of_eager_generate(arch, tmp_path):
    bundle, config = _bundle(arch, tmp_path)
    expected = _eager(arch, config)
    seq2seq = arch == "T5ForConditionalGeneration"
    assert len(set(expected[0, 1 if seq2seq else PROMPT.shape[1]:].tolist())) > 4  # varied tokens: positions matter
    assert torch.equal(_fresh_generate(bundle, tmp_path, prompt_tokens=not seq2seq), expected)
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert set(manifest["methods"]) == ({"encode", "decode"} if seq2seq else {"prefill", "decode"})
    keys = [s for s in manifest["state"] if ".keys" in s["name"]]
    assert keys and all(s["shape"][2] == CACHE and s["dtype"] == "float32" for s in keys)
    # both methods read the same weights, stored once under the model's names (besides small
    # constants the passes folded)
    model = models.transformers_model(arch, str(config))
    stored = manifest["weights"]["tensors"]
    assert {n for n in stored if not n.startswith("constants.")} <= {n for n, _ in [*model.named_parameters(), *model.named_buffers()]}
    size = sum(t.nbytes for t in {id(t): t for t in model.state_dict().values()}.values())
    assert manifest["weights"]["bytes"] < 1.1 * size


def test_generate_in_process_resets_the_cache_and_stops_at_eos(tmp_path):
    bundle, config = _bundle("LlamaForCausalLM", tmp_path)
    loaded = torchnative.load(bundle)
    expected = _eager("LlamaForCausalLM", config)
    assert torch.equal(loaded.generate(PROMPT, max_new_tokens=NEW), expected)
    assert torch.equal(loaded.generate(PROMPT, max_new_tokens=NEW), expected)  # the second starts from zeros too
    eos = int(expected[0, PROMPT.shape[1] + 5])
    first = expected[0, PROMPT.shape[1]:].tolist().index(eos)
    stopped = loaded.generate(PROMPT, max_new_tokens=NEW, eos=eos)
    assert torch.equal(stopped, expected[:, :PROMPT.shape[1] + first + 1])
    # a prompt shorter than one prefill runs on decode alone
    short = PROMPT[:, :3]
    model = models.transformers_model("LlamaForCausalLM", str(config), use_cache=True)
    with torch.no_grad():
        assert torch.equal(loaded.generate(short, max_new_tokens=8), model.generate(short, max_new_tokens=8, do_sample=False))


# xnnpack's (~30 s of .pte lowering) with -m slow; eager's writes the state the same way by default
@pytest.mark.parametrize("targets", [pytest.param("xnnpack", marks=pytest.mark.slow), "eager"])
def test_other_delegates_write_the_state_as_outputs(targets, tmp_path):
    """XNNPACK does not write in place: the cache's new values leave its partitions as outputs, and
    eager's partitions (ExportedPrograms) write the state they are given."""
    model = models.transformers_model("LlamaForCausalLM", str(_config("LlamaForCausalLM", tmp_path)), use_cache=True)
    save(compile_generation(model, [targets], cache_len=CACHE, prefill_len=PREFILL), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    if targets == "xnnpack":
        assert "xnnpack" in {p["delegate"] for m in loaded.manifest["methods"].values() for g in m["programs"]
                             for p in g["partitions"]}
    with torch.no_grad():
        assert torch.equal(loaded.generate(PROMPT, max_new_tokens=NEW), model.generate(PROMPT, max_new_tokens=NEW, do_sample=False))


def test_int4_bundle_keeps_the_cache_float_and_generates_the_dequantized_models_tokens(tmp_path):
    bundle, config = _bundle("GPT2LMHeadModel", tmp_path, "--quantize", "int4")
    manifest = json.loads((bundle / "manifest.json").read_text())
    assert all(s["dtype"] in ("float32", "int64") for s in manifest["state"])
    for name in ("prefill", "decode"):  # ONNX Runtime's 4-bit kernel, in both methods
        onnx_files = [p["artifact"] for g in manifest["methods"][name]["programs"] for p in g["partitions"]]
        kinds = {n.op_type for f in onnx_files for n in onnx.load(bundle / f, load_external_data=False).graph.node}
        assert "MatMulNBits" in kinds
    # the packed weights are stored once for both methods, and no float copy of them
    stored = manifest["weights"]["tensors"]
    assert not any(n.endswith("attn.c_attn.weight") for n in stored)
    assert sum(1 for n, t in stored.items() if t["dtype"] == "int8") == 2 * 4 + 1  # four per layer, and the LM head (its tied embedding stays float)
    assert torch.equal(_fresh_generate(bundle, tmp_path), _eager("GPT2LMHeadModel", config, "int4", activations=True))


# -- refused: a prompt the cache cannot hold, a state of the wrong shape, a tampered state spec -------
@pytest.fixture(scope="module")
def good(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    return _bundle("GPT2LMHeadModel", tmp)[0]


def test_bad_prompts_and_states(good):
    loaded = torchnative.load(good)
    with pytest.raises(BundleError, match=r"60 tokens and 8 new tokens need 67 cache positions; this bundle's KV "
                                          r"cache holds 64.*--cache-len"):
        loaded.generate(torch.zeros(1, 60, dtype=torch.long), max_new_tokens=8)
    with pytest.raises(BundleError, match=r"int64 token ids of shape \[1, n\], got torch.int32\[1, 4\]"):
        loaded.generate(torch.zeros(1, 4, dtype=torch.int32))
    with pytest.raises(BundleError, match=r"state 'cache.keys.0' is float32\[1, 4, 64, 16\], got float32\[1, 4, 32, 16\]"):
        loaded.set_state("cache.keys.0", torch.zeros(1, 4, 32, 16))
    with pytest.raises(BundleError, match=r"'cache.nothing' is not a state"):
        loaded.set_state("cache.nothing", torch.zeros(1))
    with pytest.raises(BundleError, match=r"has methods \['decode', 'prefill'\]: call one of them"):
        loaded(input_ids=torch.zeros(1, 8, dtype=torch.long))
    with pytest.raises(BundleError, match=r"'input_ids' must be int64\[1, 1\]"):
        loaded.decode(input_ids=torch.zeros(1, 2, dtype=torch.long), cache_position=torch.tensor([3]))


def _edit(bundle: Path, change) -> None:
    m = json.loads((bundle / "manifest.json").read_text())
    change(m)
    (bundle / "manifest.json").write_text(json.dumps(m))


def _shape(m: dict) -> None:
    m["state"][0]["shape"][2] = 32


def _undeclared(m: dict) -> None:
    m["state"] = m["state"][1:]


@pytest.mark.parametrize("change, message", [
    (lambda m: m.pop("state"), r"the state spec in .* is missing or malformed"),
    (lambda m: m["state"][0].pop("init"), r"the state spec in .* is missing or malformed"),
    (_shape, r"reads state 'cache.keys.0' as float32\[1, 4, 64, 16\], which the manifest's state spec declares "
             r"float32\[1, 4, 32, 16\]: the manifest was tampered with"),
    (_undeclared, r"reads state 'cache.keys.0' .* does not declare"),
])
def test_tampered_state_spec(good, tmp_path, change, message):
    copy = tmp_path / "copy.bundle"
    shutil.copytree(good, copy)
    _edit(copy, change)
    with pytest.raises(BundleError, match=message):
        torchnative.load(copy)


WINDOW, SLIDING_CACHE = 8, 96
# a prompt of two prefills and five decodes: longer than the window, and so are the new tokens
LONG = torch.randint(2, 1000, (1, 2 * PREFILL + 5), generator=torch.Generator().manual_seed(3))
_SMALL = dict(hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
              vocab_size=1000, max_position_embeddings=256)
# initial weights that make varied tokens (Gemma's scaled embeddings want transformers' default)
SLIDING = {"MistralForCausalLM": dict(_SMALL, initializer_range=0.2),
           "Gemma2ForCausalLM": dict(_SMALL, head_dim=16),  # alternating local and global layers
           "Gemma3ForCausalLM": dict(_SMALL, num_hidden_layers=6, head_dim=16),  # five local layers to a global one
           "Qwen2ForCausalLM": dict(_SMALL, use_sliding_window=True, max_window_layers=2, initializer_range=0.2),
           "Phi3ForCausalLM": dict(_SMALL, pad_token_id=0, initializer_range=0.2)}


def _sliding(arch: str, tmp: Path, window: int = WINDOW) -> tuple[Path, torch.nn.Module]:
    path = tmp / f"{arch}-{window}.json"
    path.write_text(json.dumps({**SLIDING[arch], "sliding_window": window}))
    return path, models.transformers_model(arch, str(path), use_cache=True)


# Gemma 2, Qwen2 and Phi-3 under -m slow (~25 s): Mistral's window and Gemma 3's mix of windowed and
# global layers stay in the default run
@pytest.mark.parametrize("arch", [a if a in ("MistralForCausalLM", "Gemma3ForCausalLM") else
                                  pytest.param(a, marks=pytest.mark.slow) for a in SLIDING])
def test_sliding_window_bundles_generate_eager_tokens_past_the_window(arch, tmp_path):
    """Mistral, Gemma 2, Gemma 3 (mixed layers), Qwen2 with a sliding window and Phi-3: the
    window's keys and values a ring of WINDOW slots in the bundle's state, a prompt and a
    generation longer than the window, the bundle run in a fresh process."""
    config, model = _sliding(arch, tmp_path)
    out = tmp_path / "b"
    assert cli.main(["capture-and-compile", f"transformers:{arch}", "--config", str(config), "--out", str(out),
                     "--targets", "ort", "--cache-len", str(SLIDING_CACHE), "--prefill-len", str(PREFILL)]) == 0
    with torch.no_grad():
        expected = model.generate(LONG, max_new_tokens=48, do_sample=False)
        wide = _sliding(arch, tmp_path, window=SLIDING_CACHE)[1].generate(LONG, max_new_tokens=48, do_sample=False)
    assert (expected != wide).sum() > 10  # the window decides the tokens
    assert torch.equal(_fresh_generate(out, tmp_path, prompt=LONG, new=48), expected)
    manifest = json.loads((out / "manifest.json").read_text())
    assert {p["delegate"] for m in manifest["methods"].values() for g in m["programs"] for p in g["partitions"]} == {"ort"}
    sizes = [s["shape"][2] for s in manifest["state"] if s["name"].startswith("cache.keys.")]
    kinds = getattr(model.config, "layer_types", None) or ["sliding_attention"] * model.config.num_hidden_layers
    assert sizes == [WINDOW if k == "sliding_attention" else SLIDING_CACHE for k in kinds]


def test_a_window_shorter_than_a_prefill_chunk_wraps_the_ring_inside_the_chunk(tmp_path):
    model = _sliding("Gemma3ForCausalLM", tmp_path, window=3)[1]
    save(compile_generation(model, ["eager"], cache_len=CACHE, prefill_len=PREFILL), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    with torch.no_grad():
        assert torch.equal(loaded.generate(LONG, max_new_tokens=24), model.generate(LONG, max_new_tokens=24, do_sample=False))


def test_a_cache_of_windows_only_takes_sequences_longer_than_its_cache_length(tmp_path):
    """Mistral's layers are all sliding: its state is rings only, and positions run on past the
    cache length to the model's max_position_embeddings."""
    model = _sliding("MistralForCausalLM", tmp_path)[1]
    save(compile_generation(model, ["eager"], cache_len=16, prefill_len=PREFILL), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    assert {tuple(t.shape) for t in loaded.states.values()} == {(1, 2, WINDOW, 16)}
    with torch.no_grad():
        assert torch.equal(loaded.generate(LONG, max_new_tokens=48), model.generate(LONG, max_new_tokens=48, do_sample=False))
    with pytest.raises(BundleError, match=r"need 257 positions; the model takes 256 \(max_position_embeddings\)"):
        loaded.generate(torch.ones(1, 250, dtype=torch.long), max_new_tokens=8)


@pytest.mark.slow  # ~60 s of .pte lowering each
# Gemma 2, Qwen2 and Phi-3 under -m slow (~25 s): Mistral's window and Gemma 3's mix of windowed and
# global layers stay in the default run
@pytest.mark.parametrize("arch", [a if a in ("MistralForCausalLM", "Gemma3ForCausalLM") else
                                  pytest.param(a, marks=pytest.mark.slow) for a in SLIDING])
def test_sliding_window_bundles_on_xnnpack(arch, tmp_path):
    model = _sliding(arch, tmp_path)[1]
    save(compile_generation(model, ["xnnpack"], cache_len=SLIDING_CACHE, prefill_len=PREFILL), tmp_path / "b", "test")
    loaded = torchnative.load(tmp_path / "b")
    assert "xnnpack" in {p["delegate"] for m in loaded.manifest["methods"].values() for g in m["programs"]
                         for p in g["partitions"]}
    with torch.no_grad():
        assert torch.equal(loaded.generate(LONG, max_new_tokens=48), model.generate(LONG, max_new_tokens=48, do_sample=False))


def test_a_one_call_bundle_of_a_causal_lm_whose_config_caches(tmp_path, capsys):
    """A factory's Mistral keeps transformers' use_cache=True (a DynamicCache in its outputs):
    --no-generate captures the call with use_cache=False, says so, and the bundle gives eager's logits."""
    (tmp_path / "factory.py").write_text(
        "import json, torch, transformers\n"
        f"def mistral():\n    torch.manual_seed(0)\n    return transformers.MistralForCausalLM(transformers.MistralConfig(**json.loads({json.dumps(json.dumps(dict(SLIDING['MistralForCausalLM'], sliding_window=WINDOW)))})))\n")
    out = tmp_path / "one"
    assert cli.main(["capture-and-compile", f"{tmp_path / 'factory.py'}:mistral", "--no-generate", "--targets", "ort",
                     "--out", str(out)]) == 0
    assert "captured with use_cache=False" in " ".join(capsys.readouterr().out.split())
    loaded = torchnative.load(out)
    torch.manual_seed(0)
    import transformers

    model = transformers.MistralForCausalLM(transformers.MistralConfig(**dict(SLIDING["MistralForCausalLM"], sliding_window=WINDOW)))
    assert model.config.use_cache
    ids = torch.randint(2, 1000, (1, 16), generator=torch.Generator().manual_seed(1))
    mask = torch.ones(1, 16, dtype=torch.long)
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask).logits
    assert torch.allclose(loaded(input_ids=ids, attention_mask=mask)["logits"], expected, rtol=1e-4, atol=1e-4)


def test_a_call_that_counts_in_python_is_refused():
    """State kept as a Python int that the next call reads (transformers' sliding caches keep
    one): a bundle would replay the captured count. Refused, not wrong."""
    from torchnative.bundle.build import capture_call

    class Counter:
        def __init__(self):
            self.n = 0

    class Step(torch.nn.Module):
        def forward(self, x: torch.Tensor, counter: Counter) -> torch.Tensor:
            counter.n += 1
            return x * counter.n

    with pytest.raises(BundleError, match=r"changes Python state of counter \(Counter\).*Keep such counts in tensors"):
        capture_call(Step(), {"x": torch.ones(2), "counter": Counter()})


def test_layers_with_other_state_are_refused_by_kind(tmp_path):
    """LFM2's convolution layers keep a conv state a generating bundle does not carry."""
    import transformers

    config = transformers.Lfm2Config(**{k: v for k, v in _SMALL.items() if k != "max_position_embeddings"},
                                     full_attn_idxs=[1, 3])
    with pytest.raises(BundleError, match=r"layers \[0, 2\] are 'conv'.*--no-generate"):
        compile_generation(transformers.Lfm2ForCausalLM(config).eval(), ["eager"], cache_len=CACHE, prefill_len=PREFILL)


def test_a_model_that_makes_its_own_mask_is_refused(tmp_path):
    """A bundle's masks come from positions; a model that ignores the mask it is given would
    attend with a mask made from Python counters (or none): refused at build, not wrong."""
    model = _sliding("MistralForCausalLM", tmp_path)[1]
    forward = model.model.forward
    model.model.forward = lambda *a, attention_mask=None, **k: forward(*a, **k)
    with pytest.raises(BundleError, match="did not take the prepared mask"):
        compile_generation(model, ["eager"], cache_len=CACHE, prefill_len=PREFILL)


def test_run_without_generate_on_a_generating_bundle_names_the_methods(good, capsys):
    assert cli.main(["run", str(good)]) != 0
    assert cli.main(["run", str(good), "--method", "decode"]) == 0


def test_an_encoder_decoder_takes_prompts_up_to_its_encoder_length(tmp_path):
    model = models.transformers_model("T5ForConditionalGeneration", str(_config("T5ForConditionalGeneration", tmp_path)),
                                      use_cache=True)
    save(compile_generation(model, ["eager"], cache_len=CACHE, prefill_len=12), tmp_path / "t5", "test")
    loaded = torchnative.load(tmp_path / "t5")
    for n in (1, 7, 12):  # padded to the encoder's 13 positions, the full one too
        prompt = PROMPT[:, :n]
        with torch.no_grad():
            assert torch.equal(loaded.generate(prompt, max_new_tokens=12), model.generate(prompt, max_new_tokens=12, do_sample=False))
    with pytest.raises(BundleError, match=r"a prompt of 13 tokens is longer than this bundle's encoder input \(12\)"):
        loaded.generate(torch.ones(1, 13, dtype=torch.long))

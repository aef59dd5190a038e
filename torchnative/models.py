"""Models from a spec, with example inputs: small transformers configs (random weights, no
downloads) for the demo, tests, benchmarks and `capture-and-compile`."""
from __future__ import annotations

import importlib.util
import json
import re
from pathlib import Path
from typing import Any

import torch


_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)

# config presets by transformers model_type: "tiny" for tests, "base" the architecture's default
PRESETS: dict[str, dict[str, dict]] = {
    "gpt2": {"tiny": dict(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=999,
                          eos_token_id=999), "base": {}},
    "llama": {"tiny": dict(**_TINY, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256),
              "base": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                           intermediate_size=1408, vocab_size=32000)},
    "qwen3": {"tiny": dict(**_TINY, num_key_value_heads=2, head_dim=16, vocab_size=1000, max_position_embeddings=256),
              "base": {}},
    "mistral": {"tiny": dict(**_TINY, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256), "base": {}},
    "qwen2": {"tiny": dict(**_TINY, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256), "base": {}},
    # five sliding-window layers to a global one; "base": Gemma 3 270M's shapes, a 32000-token
    # vocabulary and a window of 32 (so a short chat passes it)
    "gemma3_text": {"tiny": dict(**_TINY, num_key_value_heads=2, head_dim=16, vocab_size=1000,
                                 max_position_embeddings=256, sliding_window=16),
                    "base": dict(hidden_size=640, intermediate_size=2048, num_hidden_layers=18, num_attention_heads=4,
                                 num_key_value_heads=1, head_dim=256, vocab_size=32000, sliding_window=32)},
    "t5": {"tiny": dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_decoder_layers=2, num_heads=4, vocab_size=1000,
                       decoder_start_token_id=0),
           "base": {}},
    "bert": {"tiny": dict(**_TINY, vocab_size=1000), "base": {}},
    "vit": {"tiny": dict(**_TINY, image_size=32, patch_size=8), "base": {}},
    "resnet": {"tiny": dict(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"), "base": {}},
}
# the short names of the demo, tests and benchmarks
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "gemma3": "Gemma3ForCausalLM", "bert": "BertModel", "vit": "ViTModel",
                 "resnet": "ResNetModel"}
BUILDERS = ARCHITECTURES  # names accepted by `build`
DEFAULT_MODEL = "transformers:GPT2LMHeadModel"


class ModelSpecError(ValueError):
    """A MODEL, --config or --example-input that cannot be understood; the message says how to fix it."""


def transformers_model(architecture: str, config: str = "tiny", seed: int = 0, use_cache: bool = False) -> torch.nn.Module:
    """`transformers.<architecture>` from a preset name or a JSON config file, random weights, eval
    mode. Without `use_cache` the outputs hold no KV cache object (state a bundle does not carry)."""
    import transformers

    cls = getattr(transformers, architecture, None)
    if not (isinstance(cls, type) and issubclass(cls, torch.nn.Module) and hasattr(cls, "config_class")):
        raise ModelSpecError(f"transformers has no model class {architecture!r} (e.g. {', '.join(ARCHITECTURES.values())})")
    config_class = cls.config_class
    if Path(config).suffix == ".json":
        if not Path(config).is_file():
            raise ModelSpecError(f"config file {config} does not exist")
        try:
            cfg = config_class.from_dict(json.loads(Path(config).read_text()))
        except (json.JSONDecodeError, TypeError, ValueError) as e:
            raise ModelSpecError(f"config file {config} is not a {config_class.__name__} in JSON: {e}") from e
    else:
        presets = PRESETS.get(config_class.model_type, {})
        if config not in presets:
            known = f"presets for {config_class.model_type}: {sorted(presets)}" if presets else \
                f"no presets for model type {config_class.model_type!r} (presets exist for {sorted(PRESETS)})"
            raise ModelSpecError(f"--config {config!r} is neither a JSON file nor a preset; {known}")
        cfg = config_class(**presets[config])
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = use_cache
    torch.manual_seed(seed)
    return cls(cfg).eval()


def build(name: str, size: str = "tiny", seed: int = 0) -> torch.nn.Module:
    """A built-in model by short name (`ARCHITECTURES`), `size` a preset, random weights, eval mode."""
    return transformers_model(ARCHITECTURES[name], size, seed, use_cache=True)


def from_file(spec: str) -> Any:
    """`path/to/file.py:factory` → what `factory()` returns (a module, or (module, example inputs))."""
    path, _, factory = spec.rpartition(":")
    if not path or not factory or not Path(path).is_file():
        raise ModelSpecError(f"MODEL {spec!r}: expected path/to/file.py:factory with an existing file")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    fn = getattr(module, factory, None)
    if not callable(fn):
        raise ModelSpecError(f"{path} has no callable {factory!r}")
    return fn()


def example_inputs(name: str, model: torch.nn.Module, batch: int = 1, seq: int = 16) -> dict:
    """Inputs for a built-in model by short name."""
    return default_inputs(model, batch, seq)


def default_inputs(model: torch.nn.Module, batch: int = 1, seq: int = 16) -> dict[str, torch.Tensor]:
    """Sensible inputs for a transformers model: token ids and a full mask, or an image."""
    g = torch.Generator().manual_seed(1)
    config = getattr(model, "config", None)
    if config is None:
        raise ModelSpecError(f"{type(model).__name__} is not a transformers model: give --example-input name=dtype[shape]")
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = getattr(config, "image_size", 224)
        return {"pixel_values": torch.randn(batch, config.num_channels, size, size, generator=g)}
    ids = torch.randint(0, config.vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}


_INPUT = re.compile(r"^(?P<name>[A-Za-z_]\w*)=(?P<dtype>\w+)\[(?P<shape>[\d,\s]*)\]$")


def parse_input(spec: str) -> tuple[str, torch.dtype, tuple[int, ...]]:
    """`input_ids=int64[1,16]` → ("input_ids", torch.int64, (1, 16))."""
    m = _INPUT.match(spec.strip())
    dtype = getattr(torch, m["dtype"], None) if m else None
    if m is None or not isinstance(dtype, torch.dtype):
        raise ModelSpecError(f"--example-input {spec!r}: expected name=dtype[shape], e.g. input_ids=int64[1,16] "
                             f"or pixel_values=float32[1,3,224,224]")
    return m["name"], dtype, tuple(int(x) for x in m["shape"].split(",") if x.strip())


def random_input(name: str, dtype: torch.dtype, shape: tuple[int, ...], model: Any = None) -> torch.Tensor:
    """Random values that a model takes: ones for a mask, ids below the vocabulary size, else normal."""
    g = torch.Generator().manual_seed(1)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    if dtype == torch.bool or "mask" in name:
        return torch.ones(shape, dtype=dtype)
    high = getattr(getattr(model, "config", None), "vocab_size", None) or 2
    return torch.randint(0, high, shape, generator=g, dtype=dtype)

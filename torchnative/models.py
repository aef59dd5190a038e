"""Small built-in transformers models (random weights, no downloads) for the demo, tests and
benchmarks."""
from __future__ import annotations

from typing import Callable

import torch

_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128)


def _gpt2(size: str):
    from transformers import GPT2Config, GPT2LMHeadModel
    cfg = (GPT2Config(n_embd=64, n_layer=2, n_head=4, vocab_size=1000, n_positions=256, bos_token_id=999, eos_token_id=999) if size == "tiny"
           else GPT2Config())
    return GPT2LMHeadModel(cfg)


def _llama(size: str):
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = (LlamaConfig(**_TINY, num_key_value_heads=2, vocab_size=1000, max_position_embeddings=256) if size == "tiny"
           else LlamaConfig(hidden_size=512, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4,
                            intermediate_size=1408, vocab_size=32000))
    return LlamaForCausalLM(cfg)


def _bert(size: str):
    from transformers import BertConfig, BertModel
    cfg = BertConfig(**_TINY, vocab_size=1000) if size == "tiny" else BertConfig()
    return BertModel(cfg)


def _vit(size: str):
    from transformers import ViTConfig, ViTModel
    cfg = ViTConfig(**_TINY, image_size=32, patch_size=8) if size == "tiny" else ViTConfig()
    return ViTModel(cfg)


def _resnet(size: str):
    from transformers import ResNetConfig, ResNetModel
    cfg = (ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic")
           if size == "tiny" else ResNetConfig())
    return ResNetModel(cfg)


BUILDERS: dict[str, Callable] = {"gpt2": _gpt2, "llama": _llama, "bert": _bert, "vit": _vit, "resnet": _resnet}


def build(name: str, size: str = "tiny", seed: int = 0) -> torch.nn.Module:
    """A transformers model from a small config (`size="tiny"`) or its base config (`"base"`),
    random weights, in eval mode."""
    torch.manual_seed(seed)
    return BUILDERS[name](size).eval()


def example_inputs(name: str, model: torch.nn.Module, batch: int = 1, seq: int = 16) -> dict:
    g = torch.Generator().manual_seed(1)
    if name in ("vit", "resnet"):
        size = getattr(model.config, "image_size", 224)
        return {"pixel_values": torch.randn(batch, model.config.num_channels, size, size, generator=g)}
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids)}

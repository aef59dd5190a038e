"""llama.cpp on the same weights, for a benchmark's rows: a transformers GPT-2 or Llama model's own
tensors written to a GGUF file in float32, laid out as llama.cpp's convert_hf_to_gguf.py lays
them (GPT-2's Conv1D weights transposed to (out, in); Llama's q and k rows permuted to llama.cpp's
rotary pairs), quantized by llama.cpp itself (llama_model_quantize), and run by llama-cpp-python.

The vocabulary is a placeholder (byte-level symbols, then numbered ones): rows feed token ids,
never text. llama-cpp-python builds from its sdist (`pip install -e ".[llamacpp]"`, a few minutes
with cmake and gcc); without it the rows are skipped with that reason."""
from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import torch

# (ftype, the LM head's type): "q4_0" quantizes every matmul weight to 4 bits, the LM head too (as
# our int4 does; llama.cpp's own default keeps it at 6 bits); the token embedding, which a gather
# reads one row of, stays float32 as ours does
TYPES = {"f32": ("LLAMA_FTYPE_ALL_F32", "GGML_TYPE_F32"), "f16": ("LLAMA_FTYPE_MOSTLY_F16", "GGML_TYPE_F16"),
         "q8_0": ("LLAMA_FTYPE_MOSTLY_Q8_0", "GGML_TYPE_Q8_0"), "q4_0": ("LLAMA_FTYPE_MOSTLY_Q4_0", "GGML_TYPE_Q4_0")}


def missing() -> str:
    """Why llama.cpp rows cannot run here, or ''."""
    try:
        import gguf  # noqa: F401
        import llama_cpp  # noqa: F401
    except ImportError as e:
        return f"{e.name} is not installed (pip install -e \".[llamacpp]\": builds llama.cpp from source)"
    return ""


def _gpt2_tensors(model) -> dict[str, np.ndarray]:
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["transformer.wte.weight"], "position_embd.weight": sd["transformer.wpe.weight"],
           "output_norm.weight": sd["transformer.ln_f.weight"], "output_norm.bias": sd["transformer.ln_f.bias"],
           # the tied LM head as a tensor of its own: quantized as ours is while the embedding stays float
           "output.weight": sd["transformer.wte.weight"]}
    names = {"ln_1": "attn_norm", "attn.c_attn": "attn_qkv", "attn.c_proj": "attn_output", "ln_2": "ffn_norm",
             "mlp.c_fc": "ffn_up", "mlp.c_proj": "ffn_down"}
    for i in range(model.config.n_layer):
        for hf, ours in names.items():
            w = sd[f"transformer.h.{i}.{hf}.weight"]
            out[f"blk.{i}.{ours}.weight"] = np.ascontiguousarray(w.T) if w.ndim == 2 else w  # Conv1D: (in, out)
            out[f"blk.{i}.{ours}.bias"] = sd[f"transformer.h.{i}.{hf}.bias"]
    return out


def _rotary_pairs(w: np.ndarray, heads: int) -> np.ndarray:
    """transformers' rotate-half rows of q or k as llama.cpp's adjacent pairs."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _llama_tensors(model) -> dict[str, np.ndarray]:
    c = model.config
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    out = {"token_embd.weight": sd["model.embed_tokens.weight"], "output_norm.weight": sd["model.norm.weight"],
           "output.weight": sd.get("lm_head.weight", sd["model.embed_tokens.weight"])}
    names = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
             "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(c.num_hidden_layers):
        for hf, ours in names.items():
            w = sd[f"model.layers.{i}.{hf}.weight"]
            if ours in ("attn_q", "attn_k"):
                w = _rotary_pairs(w, c.num_attention_heads if ours == "attn_q" else c.num_key_value_heads)
            out[f"blk.{i}.{ours}.weight"] = w
    return out


def write_f32(model, path: Path) -> Path:
    """`model` (GPT2LMHeadModel or LlamaForCausalLM) as a float32 GGUF file at `path`."""
    import gguf

    c = model.config
    llama = c.model_type == "llama"
    arch = "llama" if llama else "gpt2"
    w = gguf.GGUFWriter(str(path), arch)
    w.add_context_length(c.max_position_embeddings if llama else c.n_positions)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size if llama else 4 * c.hidden_size)
    w.add_head_count(c.num_attention_heads)
    if llama:
        w.add_head_count_kv(c.num_key_value_heads)
        w.add_layer_norm_rms_eps(c.rms_norm_eps)
        w.add_rope_dimension_count(c.hidden_size // c.num_attention_heads)
        w.add_rope_freq_base(getattr(c, "rope_theta", None) or c.rope_parameters["rope_theta"])
    else:
        w.add_layer_norm_eps(c.layer_norm_epsilon)
    w.add_file_type(0)  # all float32
    symbols = [chr(0x100 + i) for i in range(256)] + [f"<{i}>" for i in range(256, c.vocab_size)]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(symbols)
    w.add_token_types([1] * c.vocab_size)
    w.add_token_merges([f"{symbols[0]} {symbols[1]}"])
    w.add_bos_token_id(c.vocab_size - 1)
    w.add_eos_token_id(c.vocab_size - 1)
    for name, t in (_llama_tensors if llama else _gpt2_tensors)(model).items():
        w.add_tensor(name, np.ascontiguousarray(t, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def quantized(f32: Path, kind: str) -> Path:
    """The float32 GGUF file quantized by llama.cpp to `kind` (TYPES)."""
    import llama_cpp

    if kind == "f32":
        return f32
    ftype, head = TYPES[kind]
    out = f32.with_name(f"{f32.stem}-{kind}.gguf")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype, params.output_tensor_type = getattr(llama_cpp, ftype), getattr(llama_cpp, head)
    params.token_embedding_type, params.nthread = llama_cpp.GGML_TYPE_F32, 2
    if llama_cpp.llama_model_quantize(str(f32).encode(), str(out).encode(), params) != 0:
        raise RuntimeError(f"llama.cpp could not quantize {f32} to {kind}")
    return out


class LlamaCppDecoder:
    """Greedy decoding of `steps` tokens after `prompt` on llama.cpp, timed as benchmarks'
    Decoder is (decode_s: each call's decode steps, the prefill left out)."""

    def __init__(self, path: Path, prompt: torch.Tensor, steps: int, threads: int):
        import llama_cpp

        self.llm = llama_cpp.Llama(model_path=str(path), n_ctx=max(128, prompt.shape[1] + steps + 1), n_threads=threads,
                                   n_threads_batch=threads, n_batch=512, verbose=False)
        self.prompt, self.steps, self.decode_s = prompt[0].tolist(), steps, []

    def _last(self) -> np.ndarray:
        """The last evaluated token's logits (llama-cpp-python keeps none without logits_all)."""
        return np.ctypeslib.as_array(self.llm._ctx.get_logits_ith(-1), shape=(self.llm.n_vocab(),))

    def _argmax(self) -> int:
        return int(np.argmax(self._last()))

    def logits(self, token: int) -> torch.Tensor:
        """The logits of the decode step that follows the prompt with `token`."""
        self.llm.reset()
        self.llm.eval(self.prompt + [token])
        return torch.from_numpy(self._last().copy())

    def __call__(self) -> list[int]:
        self.llm.reset()
        self.llm.eval(self.prompt)
        token, tokens = self._argmax(), []
        t = time.perf_counter()
        for _ in range(self.steps):
            self.llm.eval([token])
            token = self._argmax()
            tokens.append(token)
        self.decode_s.append(time.perf_counter() - t)
        return tokens

"""Greedy decoding with a generating bundle, no transformers code. A causal LM's: the prompt goes
through the `prefill` method in chunks of its length, the rest of it and every new token through
`decode`, each call at its own cache positions; the KV cache is the bundle's state, written by
both. An encoder-decoder's: `encode` of the prompt padded to its length, then `decode` from the
decoder's start token, reading the encoder's states."""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Sequence

import torch

from torchnative.bundle.format import BundleError

if TYPE_CHECKING:
    from torchnative.bundle.load import Bundle


def _eos(spec: dict, eos: int | Sequence[int] | None) -> set[int]:
    if eos is None:
        return set(spec["eos"])
    return {eos} if isinstance(eos, int) else set(eos)


def _prompt(spec: dict, input_ids: torch.Tensor, max_new_tokens: int) -> None:
    if not isinstance(input_ids, torch.Tensor) or input_ids.dim() != 2 or input_ids.shape[0] != 1 \
            or input_ids.dtype != torch.int64:
        got = f"{input_ids.dtype}{list(input_ids.shape)}" if isinstance(input_ids, torch.Tensor) else type(input_ids).__name__
        raise BundleError(f"generate takes the prompt as int64 token ids of shape [1, n], got {got}")
    n, room = input_ids.shape[1], spec.get("max_positions", spec["cache_len"])
    if n == 0:
        raise BundleError("generate needs a prompt of at least one token")
    if max_new_tokens < 0:
        raise BundleError(f"max_new_tokens must be at least 0, got {max_new_tokens}")
    if "encode" in spec:  # the encoder takes the prompt padded to its captured length; the decoder's cache the new tokens
        if n > spec["prefill_len"]:
            raise BundleError(f"a prompt of {n} tokens is longer than this bundle's encoder input ({spec['prefill_len']}); "
                              f"write the bundle again with a longer --prefill-len")
        n = 1  # the decoder's start token
    # the last new token is returned, never written: the cache holds n + max_new_tokens - 1 positions
    if n + max(max_new_tokens, 1) - 1 > room:
        if "max_positions" in spec:  # a cache of sliding windows only: the model's positions end
            raise BundleError(f"a prompt of {n} tokens and {max_new_tokens} new tokens need {n + max_new_tokens - 1} "
                              f"positions; the model takes {room} (max_position_embeddings)")
        raise BundleError(f"a prompt of {n} tokens and {max_new_tokens} new tokens need {n + max_new_tokens - 1} "
                          f"cache positions; this bundle's KV cache holds {room}. Shorten the prompt or write the "
                          f"bundle again with a longer --cache-len")


def greedy(bundle: "Bundle", input_ids: torch.Tensor, max_new_tokens: int, eos: int | Sequence[int] | None,
           on_token: Callable[[int], None] = lambda token: None) -> torch.Tensor:
    """The prompt followed by the new tokens, [1, n + new]; `on_token` is told each new token
    as it is chosen (progress, timing)."""
    spec = bundle.manifest.get("generate")
    if spec is None:
        raise BundleError(f"{bundle.path} does not generate: it holds methods {sorted(bundle.methods)}, not a causal "
                          f"LM's prefill and decode (capture-and-compile writes those for a causal LM)")
    _prompt(spec, input_ids, max_new_tokens)
    if "encode" in spec:
        return _seq2seq(bundle, spec, input_ids, max_new_tokens, _eos(spec, eos), on_token)
    prefill, decode = bundle.methods[spec["prefill"]], bundle.methods[spec["decode"]]
    chunk, tokens, positions, logits = spec["prefill_len"], spec["tokens"], spec["positions"], spec["logits"]
    stop = _eos(spec, eos)
    bundle.reset()

    def step(method, ids: torch.Tensor, at: int) -> torch.Tensor:
        return method(**{tokens: ids, positions: torch.arange(at, at + ids.shape[1])})[logits]

    n = input_ids.shape[1]
    done = 0
    while n - done >= chunk:
        last = step(prefill, input_ids[:, done:done + chunk], done)
        done += chunk
    while done < n:
        last = step(decode, input_ids[:, done:done + 1], done)
        done += 1
    out = [input_ids]
    for k in range(max_new_tokens):
        token = last[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        on_token(int(token))
        if int(token) in stop or k == max_new_tokens - 1:
            break
        last = step(decode, token, done)
        done += 1
    return torch.cat(out, dim=1)


def _seq2seq(bundle: "Bundle", spec: dict, input_ids: torch.Tensor, max_new_tokens: int, stop: set[int],
             on_token: Callable[[int], None]) -> torch.Tensor:
    """The decoder's tokens, [1, 1 + new], from its start token (as transformers returns them)."""
    encode, decode = bundle.methods[spec["encode"]], bundle.methods[spec["decode"]]
    n, width = input_ids.shape[1], spec["encoder_len"]
    ids = torch.full((1, width), spec["pad"], dtype=torch.int64)
    ids[:, :n] = input_ids
    mask = (torch.arange(width) < n).long()[None]
    bundle.reset()
    states = encode(**{spec["tokens"]: ids, spec["mask"]: mask})[spec["encoder_states"]]
    token = torch.tensor([[spec["start"]]])
    out = [token]
    for k in range(max_new_tokens):
        logits = decode(**{spec["tokens"]: token, spec["positions"]: torch.tensor([k]),
                           spec["encoder_states"]: states, spec["encoder_mask"]: mask})[spec["logits"]]
        token = logits[:, -1].argmax(-1, keepdim=True)
        out.append(token)
        on_token(int(token))
        if int(token) in stop:
            break
    return torch.cat(out, dim=1)

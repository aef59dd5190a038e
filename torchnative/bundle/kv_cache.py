"""The KV cache a causal LM's generating bundle carries as state, and the attention masks its
methods make from positions. A bundle runs without Python, so nothing here counts in Python:
every layer's keys and values are tensors of a fixed size written in place at the call's
`cache_position`, and the masks are computed in the graph from those positions, so one prefill
and one decode method serve every position.

A full-attention layer holds `cache_len` positions, position p at slot p. A sliding-window layer
whose window is shorter than that holds a ring of `window` slots, position p at slot p % window:
a chunk of tokens attends over the ring as it was before the call followed by its own keys (it
may evict positions its first tokens still see), then writes its last `window` positions into the
ring; a single token (decode) writes its slot first and attends over the ring, so the state is
read only through its write (a delegate keeps it as its own state: Core ML's). transformers' sliding caches count their length in Python (the mask's
offset and which branch `update` takes), which a bundle would replay at the captured position."""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

import torch

from torchnative.bundle.format import BundleError

FULL, SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class Layout:
    """Per layer: its attention kind and its window (None for full attention)."""
    kinds: tuple[str, ...]
    windows: tuple[int | None, ...]
    cache_len: int

    def ring(self, layer: int) -> int | None:
        """The ring size of a sliding layer whose window is shorter than the cache, else None."""
        w = self.windows[layer]
        return w if w is not None and w < self.cache_len else None

    @property
    def mixed(self) -> bool:
        return len(set(self.kinds)) > 1


def layout(model: torch.nn.Module, cache_len: int) -> Layout:
    """The cache layout of a transformers causal LM; a layer kind the bundle cannot carry (a
    recurrent or conv state, chunked attention, a layer sharing another's cache) refused by name."""
    from transformers.cache_utils import get_layer_types_and_kwargs

    kinds, kwargs = get_layer_types_and_kwargs(model.config.get_text_config(decoder=True))
    other = {k: [i for i, x in enumerate(kinds) if x == k] for k in kinds if k not in (FULL, SLIDING)}
    if other:
        what = "; ".join(f"layers {v} are {k!r}" for k, v in other.items())
        raise BundleError(f"{type(model).__name__} cannot be a generating bundle: {what}. A generating bundle carries "
                          f"the keys and values of full-attention and sliding-window layers as state; these layers "
                          f"keep other state (a recurrent or conv state, chunked attention or a cache shared with "
                          f"another layer) that it does not carry yet. Capture one call instead (--no-generate)")
    windows = tuple(kw.get("sliding_window") if k == SLIDING else None for k, kw in zip(kinds, kwargs))
    if len({w for w in windows if w is not None}) > 1:
        raise BundleError(f"{type(model).__name__}'s sliding layers have different windows {sorted(set(windows) - {None})}; "
                          f"a generating bundle takes one window for all of them")
    return Layout(tuple(kinds), windows, cache_len)


class KVState:
    """The cache's tensors, the bundle's state: per layer its keys and values, made on the first
    call (their heads and head size are the model's) and written in place after that."""

    def __init__(self, layout: Layout):
        self.layout = layout
        self.keys: list[torch.Tensor | None] = [None] * len(layout.kinds)
        self.values: list[torch.Tensor | None] = [None] * len(layout.kinds)

    def reset(self) -> None:
        for t in (*self.keys, *self.values):
            if t is not None:
                t.zero_()


def _mod(x: torch.Tensor, n: int) -> torch.Tensor:
    """x mod n, non-negative."""
    return x.remainder(n)


def _update(state: KVState, layer: int, positions: torch.Tensor, keys: torch.Tensor,
            values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ring = state.layout.ring(layer)
    if state.keys[layer] is None:  # the first (uncaptured) call
        size = ring or state.layout.cache_len
        state.keys[layer] = keys.new_zeros(*keys.shape[:2], size, keys.shape[3])
        state.values[layer] = values.new_zeros(*values.shape[:2], size, values.shape[3])
    k, v = state.keys[layer], state.values[layer]
    if ring is None:
        k.index_copy_(2, positions, keys)
        v.index_copy_(2, positions, values)
        return k, v
    if keys.shape[2] == 1:  # one token evicts a position it no longer sees: attend over the ring as written
        slots = _mod(positions, ring)
        k.index_copy_(2, slots, keys)
        v.index_copy_(2, slots, values)
        return k, v
    seen_k, seen_v = torch.cat([k, keys], dim=2), torch.cat([v, values], dim=2)  # copies, read before the write
    last = min(ring, keys.shape[2])  # the call's last `ring` positions evict the oldest
    slots = _mod(positions[-last:], ring)
    k.index_copy_(2, slots, keys[:, :, -last:])
    v.index_copy_(2, slots, values[:, :, -last:])
    return seen_k, seen_v


def _key_positions(layout: Layout, layer: int, positions: torch.Tensor) -> torch.Tensor:
    """The position each key of `layer`'s attention holds in this call; negative for a slot never
    written."""
    ring = layout.ring(layer)
    if ring is None:
        return torch.arange(layout.cache_len)
    slots = torch.arange(ring)
    if positions.shape[0] == 1:  # the ring as the token wrote it
        return positions[0] - _mod(positions[0] - slots, ring)
    before = positions[0] - 1  # the ring's newest position before the call, then the call's own
    return torch.cat([before - _mod(before - slots, ring), positions])


def _mask(layout: Layout, layer: int, positions: torch.Tensor, dtype: torch.dtype, additive: bool) -> torch.Tensor:
    keys = _key_positions(layout, layer, positions)[None, :]
    queries = positions[:, None]
    allowed = (keys >= 0) & (keys <= queries)
    window = layout.windows[layer]
    if window is not None:
        allowed = allowed & (keys > queries - window)
    allowed = allowed[None, None]
    if not additive:
        return allowed
    return torch.full(allowed.shape, torch.finfo(dtype).min, dtype=dtype).masked_fill(allowed, 0.0)


def masks(model: torch.nn.Module, state: KVState, positions: torch.Tensor) -> torch.Tensor | dict[str, torch.Tensor]:
    """The attention mask a call at `positions` passes the model, prepared (4D) so transformers
    uses it as it is: one tensor when all layers are of one kind, else one per kind (the models
    with mixed layers take a dict by kind). Boolean for SDPA, additive for eager attention."""
    layout = state.layout
    impl = model.config._attn_implementation
    if impl not in ("sdpa", "eager"):
        raise BundleError(f"a generating bundle makes the attention masks of 'sdpa' or 'eager' attention; "
                          f"{type(model).__name__} uses {impl!r}: load it with attn_implementation='sdpa'")
    dtype = next(model.parameters()).dtype
    by_kind = {kind: _mask(layout, layout.kinds.index(kind), positions, dtype, impl == "eager") for kind in layout.kinds}
    return by_kind if layout.mixed else by_kind[layout.kinds[0]]


@functools.cache
def _layer_class() -> type:
    from transformers.cache_utils import CacheLayerMixin

    class Layer(CacheLayerMixin):
        """One layer of `state` as transformers' attention calls it, for one call at `positions`."""
        is_compileable = True

        def __init__(self, state: KVState, index: int, positions: torch.Tensor):
            super().__init__()
            self.state, self.index, self.positions = state, index, positions
            self.is_sliding = state.layout.kinds[index] == SLIDING
            self.is_initialized = state.keys[index] is not None
            self.keys, self.values = state.keys[index], state.values[index]

        def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
            pass  # the state makes its tensors in `_update`

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
            return _update(self.state, self.index, self.positions, key_states, value_states)

        def get_seq_length(self) -> torch.Tensor:
            # a tensor, as transformers' static layers return: positions made from it stay in the graph
            return self.positions[0]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            raise BundleError("the model made its own attention mask over a bundle's KV cache: it did not take the "
                              "prepared mask the bundle passes as attention_mask")

        def get_max_length(self) -> int:
            return self.state.layout.cache_len

    return Layer


def step_cache(state: KVState, positions: torch.Tensor) -> Any:
    """A transformers `Cache` over `state` for one call at `positions`: made per call, so the
    object the model sees holds no Python state across calls."""
    from transformers.cache_utils import Cache

    layer = _layer_class()
    return Cache(layers=[layer(state, i, positions) for i in range(len(state.layout.kinds))])

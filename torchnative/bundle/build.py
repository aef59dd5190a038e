"""A model's calls, captured and compiled for a bundle: each call (a *method*: `forward`, or a
causal LM's `prefill` and `decode`) is recorded on eager (fast, no compile), described as a replay
trace (replay/trace.py: programs in order, where each input comes from, the scalars Python
read), then each program is built again for the target delegates with its artifacts kept.

A causal LM's methods run over a static KV cache, the bundle's *state*: the tensors the cache
object holds, named by where they are in it, written by the methods' graphs and shared by them."""
from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Sequence

import torch
from torch.utils import _pytree as pytree

from torchnative.bundle import buckets, dynamic as dynamic_sizes, kv_cache
from torchnative.bundle.format import BundleError
from torchnative.delegates import resolve
from torchnative.passes.pin import name_tensors
from torchnative.replay.guard import SCALARS, Snapshot
from torchnative.build.pipeline import build_program
from torchnative.replay.trace import Ineligible, Trace
from torchnative.replay.tracer import Tracer
from torchnative.replay.session import real_outputs, session


@dataclass
class CompiledMethod:
    trace: Trace                       # its programs built for the targets, artifacts kept
    inputs: dict[str, torch.Tensor]    # the example inputs, by argument name
    output_names: list[str]            # one per flattened output leaf
    reference: list                    # eager's flattened outputs on the example inputs
    size: dict | None = None           # the size n its dynamic dims share (bundle/dynamic.py), if any
    symbols: list[dict] = field(default_factory=list)  # per graph: its rules' symbols as (coef, const) of n


@dataclass
class CompiledBuckets:
    """A method run as buckets (bundle/buckets.py): the methods compiled at each bucket's size."""
    inputs: dict[str, torch.Tensor]    # the example inputs, by argument name
    output_names: list[str]
    reference: list                    # eager's flattened outputs on the example inputs
    size: dict                         # the size n its dynamic dims share (bundle/dynamic.py)
    buckets: list[tuple[int, bool, str]]  # (size, padded, the method compiled for it)
    slices: list[list]                 # per output: the dims that follow n, as (dim, expression in n)


class Captured(NamedTuple):
    trace: Trace
    run_inputs: list  # per graph run: its inputs
    out: Any
    recorded: list  # per graph run: its graph (recording.trie.Recorded)


@dataclass
class Compiled:
    methods: dict[str, CompiledMethod | CompiledBuckets]  # "forward", or a causal LM's "prefill" and "decode"
    weight_names: dict[int, str]       # id(parameter or buffer) -> its name in the model
    states: dict[int, tuple[str, torch.Tensor]] = field(default_factory=dict)  # id -> (name, tensor)
    generation: dict | None = None     # how `Bundle.generate` drives the methods (see `compile_generation`)
    notes: list[str] = field(default_factory=list)  # what the capture chose that a user should know


def leaf_name(path: tuple) -> str:
    """`(MappingKey('logits'),)` -> "logits"; a tuple position -> "output_0"."""
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        parts.append(str(key) if not isinstance(key, int) else f"output_{key}" if not parts else str(key))
    return ".".join(parts) or "output"


def capture_call(model: torch.nn.Module, inputs: dict[str, Any], states: frozenset[int] = frozenset()) -> Captured:
    """The trace of `model(**inputs)` recorded on eager, its graphs' run inputs, the output, and
    the graphs as recorded. `states`: ids of the tensors the call may write (a static KV cache's)."""
    buffers = frozenset(id(b) for b in model.buffers())
    leaves = list(inputs.values())
    objects = {i: v for i, v in enumerate(leaves) if not isinstance(v, torch.Tensor) and type(v) not in SCALARS}
    before = {i: Snapshot(v) for i, v in objects.items()}
    tracer = Tracer()
    with torch.no_grad(), session(["eager"], buffers, tracer, compile_after=1, sites=None):
        out = model(**inputs)
    out = real_outputs(out)
    after = {i: Snapshot(v) for i, v in objects.items()}
    names = list(inputs)
    changed = [f"{names[i]} ({type(v).__name__})" for i, v in objects.items() if after[i].state != before[i].state]
    if changed:  # a Python counter (transformers' sliding-window caches keep one) that the next call reads: a bundle has no Python
        raise BundleError(f"the call of {type(model).__name__} changes Python state of {', '.join(changed)} that later "
                          f"calls read (a counter, not a tensor); a bundle carries only tensors as state. Keep such "
                          f"counts in tensors (a generating bundle's own KV cache does: bundle/kv_cache.py)")
    is_weight = lambda x: isinstance(x, torch.nn.Parameter) or id(x) in buffers  # noqa: E731
    try:
        with torch.no_grad():
            # the bundle's state and constants are these tensors themselves
            trace = tracer.trace(leaves, is_weight, out, before, after, objects=False).held(before)
    except Ineligible as e:
        raise BundleError(f"this call of {type(model).__name__} cannot be saved as a bundle: {e}. A bundle "
                          f"runs without the model's Python, so everything the call computes must pass "
                          f"through captured graphs") from e
    if any(w[0] != "const" or id(w[1]) not in states for step in trace.calls for w in step.writes):
        raise BundleError(f"{type(model).__name__} writes into tensors during the call (state such as a KV "
                          f"cache or BatchNorm statistics in train mode); a bundle carries only a causal LM's "
                          f"static KV cache as state (capture-and-compile of a causal LM does so by default)")
    return Captured(trace, [run[1] for run in tracer.runs], out, tracer.recorded)


def compile_trace(captured: Captured, targets: Sequence[str] | None, quantize: str | None = None) -> Trace:
    """Each program of the captured trace built again for `targets` (preference order), artifacts
    kept; from its graph as recorded at these sizes (the program that ran it may be a template's,
    with rules for sizes other calls of the process had: a bundle method is static unless
    --dynamic says)."""
    delegates = resolve(targets)
    calls = tuple(dataclasses.replace(call, program=build_program(recorded.graph(), delegates, args, quantize,
                                                                  keep_artifacts=True))
                  for call, args, recorded in zip(captured.trace.calls, captured.run_inputs, captured.recorded))
    return dataclasses.replace(captured.trace, calls=calls)


def prepare_model(model: torch.nn.Module, inputs: dict[str, torch.Tensor]) -> list:
    """Eval mode, tensors named for pinning; eager's flattened outputs on `inputs`."""
    model.eval()
    name_tensors(model)
    with torch.no_grad():
        return pytree.tree_leaves(model(**inputs))


def method(inputs: dict[str, Any], trace: Trace, out: Any, reference: list) -> CompiledMethod:
    paths, _ = pytree.tree_flatten_with_path(out)
    tensors = {k: v for k, v in inputs.items() if isinstance(v, torch.Tensor)}
    return CompiledMethod(trace, tensors, [leaf_name(p) for p, _ in paths], reference)


def weight_names(model: torch.nn.Module) -> dict[int, str]:
    names: dict[int, str] = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(t), n)  # a tied weight is saved once, under its first name
    return names


def compile_call(model: torch.nn.Module, inputs: dict[str, torch.Tensor], targets: Sequence[str] | None,
                 quantize: str | None = None, dynamic: dynamic_sizes.Dynamic | None = None) -> Compiled:
    """Capture `model(**inputs)` and compile each of its graphs for `targets` (preference order);
    with `dynamic`, for every size of its dims in the range (bundle/dynamic.py). A model that
    generates is captured with `use_cache=False` unless the inputs say otherwise: one call's
    outputs, no KV cache object (a bundle carries a cache only as a generating bundle's state)."""
    config = getattr(model, "config", None)
    if generates(model) and getattr(config, "use_cache", False) and "use_cache" not in inputs:
        config.use_cache = False
        try:
            compiled = compile_call(model, inputs, targets, quantize, dynamic)
        finally:
            config.use_cache = True
        compiled.notes.append("captured with use_cache=False (the config's use_cache=True would return a KV cache "
                              "object): one call's outputs; a generating bundle is --generate")
        return compiled
    reference = prepare_model(model, inputs)
    if dynamic is not None and not all(d.dynamic for d in resolve(targets)):
        return _bucketed(model, inputs, reference, targets, quantize, dynamic)
    if dynamic is not None:
        return Compiled({"forward": _dynamic_method(model, inputs, reference, targets, quantize, dynamic)},
                        weight_names(model))
    captured = capture_call(model, inputs)
    forward = method(inputs, compile_trace(captured, targets, quantize), captured.out, reference)
    return Compiled({"forward": forward}, weight_names(model))


def _dynamic_method(model: torch.nn.Module, inputs: dict[str, torch.Tensor], reference: list,
                    targets: Sequence[str] | None, quantize: str | None, dynamic: dynamic_sizes.Dynamic) -> CompiledMethod:
    """The call captured at three sizes of n, each graph compiled once for every n of the range."""
    example = dynamic_sizes.example_size(inputs, dynamic)
    ns = dynamic_sizes.samples(example, dynamic)
    captured = [capture_call(model, dynamic_sizes.resized(inputs, dynamic, n)) for n in ns]
    if len({len(c.trace.calls) for c in captured}) != 1:
        raise BundleError(f"the call records another number of graphs at n = {ns[0]}, {ns[1]} and {ns[2]} (its graph "
                          f"breaks depend on n): it cannot be compiled for a range of n")
    calls, outputs = dynamic_sizes.sized_sources([c.trace for c in captured], ns)
    sized = [dynamic_sizes.template(k, [c.recorded[k] for c in captured], ns, captured[1].run_inputs[k], targets, quantize,
                                    dynamic)
             for k in range(len(calls))]
    low, high = max(s.low for s in sized), min(s.high for s in sized)
    if low > dynamic.low or high < dynamic.high:
        dims = ",".join(f"{name}:{d}" for name, d in dynamic.dims)
        raise BundleError(f"{type(model).__name__} takes n from {low} to {high} only (a table it indexes by "
                          f"position, or a size that must stay 2 or more), not {dynamic.low}..{dynamic.high}: "
                          f"use --dynamic {dims}={max(low, dynamic.low)}..{min(high, dynamic.high)}")
    trace = dataclasses.replace(captured[0].trace, outputs=outputs,
                                calls=tuple(dataclasses.replace(s, program=z.program) for s, z in zip(calls, sized)))
    forward = method(inputs, trace, captured[0].out, reference)
    return dataclasses.replace(forward, size=dynamic.record(example), symbols=[z.symbols for z in sized])


def _bucketed(model: torch.nn.Module, inputs: dict[str, torch.Tensor], reference: list, targets: Sequence[str] | None,
              quantize: str | None, dynamic: dynamic_sizes.Dynamic) -> Compiled:
    """The call compiled at each bucket's size (bundle/buckets.py), for targets that compile static
    shapes; each padded bucket checked on eager to leave the real positions' outputs unchanged."""
    buckets.check_masked(dynamic)
    example = dynamic_sizes.example_size(inputs, dynamic)
    with torch.no_grad():
        names = [leaf_name(p) for p, _ in pytree.tree_flatten_with_path(model(**inputs))[0]]
    slices = buckets.output_slices(model, inputs, dynamic, min(max(example, dynamic.low), dynamic.high - 1))
    methods: dict[str, CompiledMethod | CompiledBuckets] = {}
    made, below = [], dynamic.low
    for size, padded in buckets.sizes(dynamic):
        name = f"forward_{size}" if padded else f"forward_{size}_unpadded"
        # captured at the largest n it serves: a delegate that calibrates (QNN) sees real positions
        n = size - 1 if padded else size
        at_n = dynamic_sizes.resized(inputs, dynamic, n)
        if padded:
            buckets.check_padding(model, inputs, dynamic, below, size, names, slices)  # the most padding it takes
            expected = buckets.check_padding(model, inputs, dynamic, n, size, names, slices)
            at_n = buckets.pad(at_n, dynamic.dims, size)
        else:
            expected = prepare_model(model, at_n)
        captured = capture_call(model, at_n)
        methods[name] = method(at_n, compile_trace(captured, targets, quantize), captured.out, expected)
        made.append((size, padded, name))
        below = size
    forward = CompiledBuckets(inputs, names, reference, dynamic.record(example), made, slices)
    return Compiled({"forward": forward, **methods}, weight_names(model))


def generates(model: torch.nn.Module) -> bool:
    """A transformers model that generates token by token from its own outputs: a causal LM, or
    an encoder-decoder (T5, BART)."""
    config = getattr(model, "config", None)
    can = getattr(model, "can_generate", None)
    return config is not None and callable(can) and can()


def _cache_argument(model: torch.nn.Module) -> str:
    # transformers 5 names the argument `cache` (`past_key_values` is deprecated), 4 `past_key_values`
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


class _CacheStep(torch.nn.Module):
    """One call of a causal LM over the bundle's KV cache (bundle/kv_cache.py): the logits of
    `input_ids` at `cache_position`, attending through masks made from those positions."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, cache: kv_cache.KVState) -> dict[str, torch.Tensor]:
        out = self.model(input_ids=input_ids, position_ids=cache_position[None],
                         attention_mask=kv_cache.masks(self.model, cache, cache_position), use_cache=True,
                         **{_cache_argument(self.model): kv_cache.step_cache(cache, cache_position)})
        return {"logits": out.logits}


class _Encode(torch.nn.Module):
    """An encoder-decoder's encoder: the hidden states the decoder's cross-attention reads."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.model.get_encoder()(input_ids=input_ids, attention_mask=attention_mask)
        return {"encoder_hidden_states": out.last_hidden_state}


class _DecoderStep(torch.nn.Module):
    """One decoder call of an encoder-decoder over a static self-attention cache. Cross-attention
    keys and values are computed from the encoder's states in every call: transformers caches
    them behind a Python flag per layer (`is_updated`), state a bundle cannot replay."""

    def __init__(self, model: torch.nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor, encoder_hidden_states: torch.Tensor,
                encoder_attention_mask: torch.Tensor, cache: Any) -> dict[str, torch.Tensor]:
        from transformers import DynamicCache, EncoderDecoderCache

        both = EncoderDecoderCache(cache, DynamicCache(config=self.model.config))
        out = self.model(decoder_input_ids=input_ids, encoder_outputs=(encoder_hidden_states,),
                         attention_mask=encoder_attention_mask, cache_position=cache_position, use_cache=True,
                         **{_cache_argument(self.model): both})
        return {"logits": out.logits}


def state_tensors(obj: Any, path: str = "cache") -> dict[str, torch.Tensor]:
    """The tensors an object holds (its attributes, lists and dicts, recursively), by path:
    "cache.keys.0"."""
    found: dict[str, torch.Tensor] = {}
    seen: set[int] = set()

    def walk(x: Any, at: str) -> None:
        if isinstance(x, torch.Tensor):
            if id(x) not in seen:
                found[at] = x
            seen.add(id(x))
            return
        if id(x) in seen or isinstance(x, (type, torch.nn.Module, str, bytes, int, float, bool, torch.device, torch.dtype)):
            return
        seen.add(id(x))
        items = enumerate(x) if isinstance(x, (list, tuple)) else x.items() if isinstance(x, dict) else \
            vars(x).items() if hasattr(x, "__dict__") else ()
        for k, v in items:
            walk(v, f"{at}.{k}")

    walk(obj, path)
    return found


def _calls(model: torch.nn.Module, prefill_len: int, seed: int) -> dict[str, tuple[torch.nn.Module, dict, bool]]:
    """The calls to capture: name -> (module, example inputs, whether it takes the cache)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, model.config.vocab_size, (1, prefill_len), generator=g)
    if not model.config.is_encoder_decoder:
        step = _CacheStep(model)
        return {"prefill": (step, {"input_ids": ids, "cache_position": torch.arange(prefill_len)}, True),
                "decode": (step, {"input_ids": ids[:, :1].clone(), "cache_position": torch.tensor([prefill_len])}, True)}
    # a prompt of up to `prefill_len` tokens, padded by one at least: transformers skips the mask
    # when it has no padding (reading its value: a path check), and the bundle takes the masked path
    # always (the same values for a prompt of every length)
    ids = torch.cat([ids, torch.full((1, 1), model.generation_config.pad_token_id or 0)], dim=1)
    mask = (torch.arange(prefill_len + 1) < prefill_len).long()[None]
    encode = _Encode(model)
    with torch.no_grad():
        states = encode(ids, mask)["encoder_hidden_states"]
    start = torch.tensor([[model.generation_config.decoder_start_token_id or 0]])
    return {"encode": (encode, {"input_ids": ids, "attention_mask": mask}, False),
            "decode": (_DecoderStep(model), {"input_ids": start, "cache_position": torch.tensor([0]),
                                             "encoder_hidden_states": states, "encoder_attention_mask": mask}, True)}


def _check_kv_cache(model: torch.nn.Module, cache: kv_cache.KVState, prefill_len: int) -> None:
    """The bundle's cache and masks give the model's own logits: a sequence past the smallest
    window (so the rings wrap) in prefill chunks then single tokens, against one call of the model
    on all of it without a cache. A model that makes its masks its own way is refused, not wrong."""
    windows = [w for w in cache.layout.windows if w is not None and w < cache.layout.cache_len]
    n = min(cache.layout.cache_len, max(2 * prefill_len, min(windows, default=0) + prefill_len + 2))
    ids = torch.randint(2, model.config.vocab_size, (1, n), generator=torch.Generator().manual_seed(0))
    step, got, at = _CacheStep(model), [], 0
    with torch.no_grad():
        while at < n:
            width = prefill_len if n - at >= prefill_len else 1
            got.append(step(ids[:, at:at + width], torch.arange(at, at + width), cache)["logits"])
            at += width
        expected = model(input_ids=ids, use_cache=False).logits
    got = torch.cat(got, dim=1)
    diff = ((got - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    if not diff < (1e-4 if got.dtype == torch.float32 else 3e-2):  # half types round per op, in another order here
        raise BundleError(f"{type(model).__name__} over a bundle's KV cache gives other logits than the model "
                          f"alone (max rel diff {diff:.2g} over {n} tokens): its attention does not follow the "
                          f"prepared masks the bundle passes. Capture one call instead (--no-generate)")


def compile_generation(model: torch.nn.Module, targets: Sequence[str] | None, quantize: str | None = None,
                       cache_len: int = 128, prefill_len: int = 16, seed: int = 1) -> Compiled:
    """A generating model as methods over one static KV cache, the bundle's state. A causal LM:
    `prefill` (`prefill_len` tokens at once) and `decode` (one token), each taking `input_ids`
    and their `cache_position`s and returning the logits; `Bundle.generate` prefills a prompt in
    chunks of `prefill_len`, decodes the rest of it token by token, then decodes greedily. An
    encoder-decoder: `encode` (a prompt of up to `prefill_len` tokens padded to `prefill_len + 1`,
    and its mask) and `decode`
    (one decoder token, reading the encoder's states)."""
    from transformers import StaticCache

    if not generates(model):
        raise BundleError(f"{type(model).__name__} does not generate (not a transformers causal LM or "
                          f"encoder-decoder): capture one call of it instead (--no-generate)")
    if not 0 < prefill_len < cache_len:
        raise BundleError(f"the prefill length ({prefill_len}) must be at least 1 and less than the cache length ({cache_len})")
    model.eval()
    name_tensors(model)
    calls = _calls(model, prefill_len, seed)
    if model.config.is_encoder_decoder:
        cache = StaticCache(config=model.config, max_cache_len=cache_len)
        with torch.no_grad():  # the cache makes its tensors on the first call: not in a graph
            calls["decode"][0](**calls["decode"][1], cache=cache)
    else:
        cache = kv_cache.KVState(kv_cache.layout(model, cache_len))
        _check_kv_cache(model, cache, prefill_len)  # and the cache makes its tensors: not in a graph
    cache.reset()
    states = state_tensors(cache)
    if any(t.any() for t in states.values()):
        raise BundleError(f"{type(cache).__name__}.reset() leaves {[n for n, t in states.items() if t.any()][:3]} "
                          f"non-zero; a bundle's state starts at zeros")
    ids_of = frozenset(map(id, states.values()))
    methods = {}
    for name, (module, inputs, cached) in calls.items():
        captured = capture_call(module, {**inputs, "cache": cache} if cached else inputs, ids_of)
        methods[name] = method(inputs, compile_trace(captured, targets, quantize), captured.out,
                               pytree.tree_leaves(captured.out))
    config = model.generation_config
    eos = config.eos_token_id
    generation = {"decode": "decode", "prefill_len": prefill_len, "cache_len": cache_len,
                  "tokens": "input_ids", "positions": "cache_position", "logits": "logits",
                  "eos": [] if eos is None else [eos] if isinstance(eos, int) else list(eos)}
    if model.config.is_encoder_decoder:
        generation.update(encode="encode", mask="attention_mask", encoder_states="encoder_hidden_states",
                          encoder_mask="encoder_attention_mask", encoder_len=prefill_len + 1, pad=config.pad_token_id or 0,
                          start=config.decoder_start_token_id or 0)
    else:
        generation["prefill"] = "prefill"
        if all(cache.layout.ring(i) for i in range(len(cache.layout.kinds))):  # rings only: no position runs out
            generation["max_positions"] = getattr(model.config, "max_position_embeddings", None) or cache_len
    return Compiled(methods, weight_names(model), {id(t): (n, t) for n, t in states.items()}, generation)

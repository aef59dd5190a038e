"""torchnative: graph capture at PyTorch's aten dispatch door.

Eager programs run unmodified; the aten ops they issue are recorded into Core ATen graphs,
cut where Python needs a value, and run as compiled programs, with eager semantics.
"""
from __future__ import annotations

import warnings
from contextlib import AbstractContextManager, contextmanager
from typing import Any, Callable, Iterator, Sequence

from torchnative import threads

threads.before_torch()  # before torch loads its OpenMP runtime
import torch  # noqa: E402

from torchnative import quiet  # noqa: E402

quiet.install()

from torchnative import events, store
from torchnative.bundle import Bundle, BundleError
from torchnative.bundle import load as _load
from torchnative.delegates import REGISTRY as _REGISTRY
from torchnative.inspector.explain import Explanation
from torchnative.inspector.explain import explain as _explain
from torchnative.inspector.profile import Profile, ProfileError
from torchnative.inspector.profile import profile as _profile
from torchnative.interface import Availability
from torchnative.passes.pin import name_tensors as _name_tensors
from torchnative.passes.pin import pin as _pin
from torchnative.passes.pin import pinned as _pinned
from torchnative.passes.quantize import ALL_SCHEMES as _ALL_SCHEMES
from torchnative.cache import calibration as _calibration
from torchnative.replay.accelerated import install as _install
from torchnative.replay.accelerated import uninstall as _uninstall
from torchnative.build.program import CapturedOpError
from torchnative.cache.program_cache import DEFAULT_COMPILE_AFTER as _COMPILE_AFTER
from torchnative.cache.program_cache import CACHE as _CACHE
from torchnative.cache.program_cache import wait_for_compiles as _wait_for_compiles
from torchnative.replay.session import session as _session
from torchnative.shim import LazyTensor

# the public surface; every other name here is private (the layers' own modules hold the rest)
__all__ = ["accelerate", "deaccelerate", "capture", "calibrate", "explain", "profile", "pin", "pinned", "stats",
           "reset_stats", "availability", "load", "set_cache_dir", "set_memory_limit", "set_verify", "wait_for_compiles", "Bundle", "BundleError", "Profile", "ProfileError",
           "CapturedOpError", "Explanation", "Availability", "LazyTensor"]
__version__ = "0.1.0"

@contextmanager
def capture(delegates: Sequence[str] | None = None, *, compile_after: int | None = _COMPILE_AFTER,
            quantize: str | None = None, background: bool | None = None) -> Iterator[None]:
    """Capture every aten op run inside the block.

    Ops are recorded lazily and run as compiled graphs when Python needs a value (`.item()`,
    `bool()`, `.tolist()`, printing, data-dependent shapes, ...) and when the block ends. Tensors
    created inside stay valid after it.

    Args:
        delegates: preference order of delegates for the captured graphs, e.g. `["ort"]`
            (default: `torchnative.delegates.DEFAULT`, those of it that execute here); eager
            always runs what no other delegate takes.
        compile_after: a graph runs on eager until it has run this many times; then it is
            compiled for the delegates. Compiling costs seconds, and a graph seen once (a new
            shape at every decode step) never repays it; 1 compiles every graph at once. None
            (the default, unless TORCHNATIVE_COMPILE_AFTER=N sets a count): the cost rule — a
            graph compiles once its runs on eager took a fifth of its compile's estimated
            seconds (a 20 ms decode step: after ~40 runs; a tiny model's 1 ms graph: after
            dozens), at least twice; `explain()` says why a graph is not compiled yet.
        quantize: `"int8"` (per output channel) or `"int4"` (groups of 32) for the float weights
            (parameters and buffers that are not pinned) that feed matmuls and convolutions;
            `"q8_0"` or `"q4k"` (GGUF k-quants, made by candle; needs candle-nn) for those that are
            a matmul's 2-D weight: the `candle` delegate runs them with its k-quant kernels;
            `"palettize4"` (16 values per output channel, found by k-means), which `coreai` keeps
            as Core AI's lookup table and 4-bit indices;
            `torchnative.passes.quantize.dequantized(w, scheme)` is the weight the graph uses
            where a matmul reads it. On `ort`, matmuls of such weights run ONNX Runtime's
            low-bit kernels, which quantize the activations too: int8 as MatMulInteger (per
            tensor, dynamically), int4 as MatMulNBits on its int8 path (blocks of 32); each
            within ~1 % of the largest output of the dequantized weights' result on GPT-2 small's
            logits (benchmarks/quantized_decode.py), and that of the model
            `passes.quantize.dequantized_copy(model, scheme, activations=True)` makes, to rounding.
            Other delegates compute with the dequantized values.
            Graphs that autograd records (grad mode on, an input requiring grad) stay float32,
            with a warning: their backward would run on the float weights autograd saved.
        background: compile a graph's program on a background thread while the graph goes on
            running on eager, its program used from the first call after it is ready (None, the
            default: on, unless the environment sets TORCHNATIVE_BACKGROUND_COMPILE=0); False
            compiles in the call that needs the program. A weight written while its program
            compiles is pinned and the program built again. `wait_for_compiles()` blocks until
            they are done; at exit, compiles not yet started are dropped.
    """
    _check_quantize(quantize)
    with _session(delegates, compile_after=compile_after, quantize=quantize, background=background):
        yield


def _check_quantize(scheme: str | None) -> None:
    if scheme is not None and scheme not in _ALL_SCHEMES:
        raise ValueError(f"quantize={scheme!r} is not a weight quantization scheme; choose one of {_ALL_SCHEMES} or None")


def accelerate(model: torch.nn.Module, *, delegates: Sequence[str] | None = None,
               replay: bool = True, compile_after: int | None = _COMPILE_AFTER, quantize: str | None = None,
               background: bool | None = None, replay_new_sizes: bool = True) -> torch.nn.Module:
    """Capture `model`'s forward (and so `generate`) on every call; returns the same module.

    With `replay` (the default), a call whose recording ran only compiled graphs and read only
    scalars of them is replayed without running `forward`'s Python once two consecutive calls with
    the same argument metadata and training flags recorded the same graphs; a scalar that comes out different, a
    changed weight, or an attribute set on the model or a submodule records the call again (a float
    attribute set to another float, `bn.momentum = m`, is followed instead: replays compute what
    Python made of it again, docs/accelerate.md), and a call that sets a module attribute itself is
    never replayed. Other Python-only
    side effects of `forward` (appending to a list) do not happen on a replayed call: pass
    `replay=False` if `forward` has them.

    A call at sizes never seen (a decode step over a longer cache, a new prompt length) replays
    the trace that calls at three or more other sizes recorded alike, when its sizes follow the
    same rules and lie between the least and greatest of those sizes; a size beyond them is
    recorded, so a Python branch on a size (`if kv_len > window`) is seen before it is replayed
    across. `replay_new_sizes=False` records every size never seen, for a forward that branches
    on sizes between ones it was called at (`if n % 64 == 0`) (replay/new_sizes.py).

    A parameter or buffer written between two runs of one graph (an optimizer step in a
    test-time-adaptation loop) is pinned: its program is rebuilt once with it as an input.

    `delegates`, `compile_after`, `quantize` and `background` are as in `capture`; a call is
    not replayed while one of its graphs compiles in the background. Idempotent. Outputs equal
    eager's (with `quantize`, eager's with the dequantized weights); `deaccelerate(model)`
    restores the original forward. A copy (`copy.deepcopy`, `pickle`, `torch.save`/`torch.load`
    with `weights_only=False`) of an accelerated module is accelerated with the same settings,
    on its own weights, with capture state of its own.
    """
    _check_quantize(quantize)
    _name_tensors(model)
    _install(model, delegates, replay, compile_after, quantize, background, replay_new_sizes)
    return model


def deaccelerate(model: torch.nn.Module) -> torch.nn.Module:
    """Undo `accelerate(model)`; a model that is not accelerated is returned unchanged."""
    _uninstall(model)
    return model


def calibrate() -> AbstractContextManager[None]:
    """Calls inside the block are a calibration set for delegates that quantize activations
    (`qnn`): each graph runs on eager and its inputs are kept (up to 64 sets per graph); the
    program built for that graph after the block calibrates on all of them, besides the inputs it
    is built with. Without it, activations are calibrated on those inputs alone.

        model = torchnative.accelerate(model, delegates=["qnn"])
        with torchnative.calibrate():
            for batch in calibration_batches:
                model(**batch)
        model(**inputs)   # compiled for HTP, calibrated on every batch and these inputs
    """
    return _calibration.calibrate()


def explain(fn: Callable, *args: Any, check: bool = False, **kwargs: Any) -> Explanation:
    """Run `fn(*args, **kwargs)` under capture and report what was captured.

    Returns an Explanation with `graphs` (CapturedGraphs; `.ops()` lists each one's ops),
    `breaks` (reason, op, filename, line of each graph break), `fallbacks` (delegate and reason
    of each partition that failed to compile or run and ran on eager), `op_counts` and `output`.

    With `check=True`, every run of a delegate's partition is compared with the partition's own
    graph run on eager on the same inputs (no second run of `fn`): `gaps` holds one
    `PartitionGap` per partition (delegate, ops, source lines, max abs and max rel error of each
    output, the worst over its runs, and whether it `diverges`), and the text shows them. Each
    partition is checked on the inputs it was given, so the one that diverges is the one whose
    gap is not ~0, whatever runs after it.
    """
    return _explain(fn, *args, check=check, **kwargs)


def profile() -> AbstractContextManager[Profile]:
    """Record where time goes inside the block: `with torchnative.profile() as prof: ...`.

    When the block ends, `prof.summary()` is a text report (time and op coverage per delegate,
    top partitions with p50/p95 and the source lines their ops came from, declined ops with each
    delegate's reason, fallbacks, graph breaks by file:line, state/pinned tensors, compile
    times) and `prof.save(path)` writes it for `torchnative inspect` (terminal, `--html`,
    `--trace`). Off by default; outside a profile nothing is timed.
    """
    return _profile()


def pin(x: torch.Tensor | torch.nn.Module) -> None:
    """Mark a tensor, or every parameter of a module, as updated at test time (fast weights,
    adapted parameters): never folded or quantized, and passed to delegates as an input on every
    call. (A parameter written between two runs of a graph is pinned without asking.)"""
    tensors = list(x.parameters()) if isinstance(x, torch.nn.Module) else [x]
    if not tensors or not all(isinstance(t, torch.Tensor) for t in tensors):
        raise TypeError(f"pin() takes a tensor or a module with parameters, not {type(x).__name__}")
    if isinstance(x, torch.nn.Module):
        _name_tensors(x)
    for t in tensors:
        _pin(t, "pinned by torchnative.pin()")


def pinned() -> list[torch.Tensor]:
    """Every live pinned tensor (by `pin`, or pinned because it changed between two runs)."""
    return _pinned()


def availability() -> dict[str, Availability]:
    """Every delegate with its status here: `executes`, `compile-only` or `unavailable`, with the
    reason and an install hint when it is not fully usable."""
    return {name: d.available() for name, d in _REGISTRY.items()}


def stats() -> dict:
    """Counters since the last reset: ops recorded, graphs built, program cache hits and misses,
    graph runs, sync points by reason, fallbacks, replays (`new_size_replays`: of them, at sizes never seen), tensors pinned (label → why),
    weights quantized (or why not), values folded (computed from weights once, at build) and
    composites fused (by name) into the partitions compiled in this process, and graph runs on
    eager while their program compiled in the background (`compiling_runs`), and entries each
    bounded table dropped (`evicted`, see `set_memory_limit`)."""
    return events.STATS.as_dict()


def wait_for_compiles() -> None:
    """Block until every program compiling in the background is built (see `capture`'s
    `background`); the next call that runs its graph uses it."""
    _wait_for_compiles()


def reset_stats() -> None:
    """Zero the counters of `stats()`."""
    events.STATS = events.Stats()


def load(path: str) -> Bundle:
    """Load a bundle written by `torchnative capture-and-compile` (a directory or a .zip): checks its
    schema, every file's hash and that its delegates execute here (`BundleError` says what is wrong).
    The returned callable takes the captured inputs by name and returns a dict of outputs; it runs
    without the model's Python code."""
    return _load(path)


def set_memory_limit(graphs: int) -> None:
    """Keep compiled programs of at most `graphs` graphs in memory (default
    `torchnative.cache.program_cache.LIMIT`, 256); the tables that decide when to compile (run
    counts, sizes seen, templates, calibration sets) scale with it. The least recently used are
    dropped, and compiled again if their graph comes back; `stats()["evicted"]` counts what each
    table dropped. Results never depend on it."""
    if graphs < 1:
        raise ValueError(f"set_memory_limit: graphs must be at least 1, got {graphs}")
    _CACHE.resize(graphs)


def set_verify(enabled: bool) -> None:
    """Whether programs built from now on check each delegate partition against eager before
    trusting it (on by default; TORCHNATIVE_VERIFY=0 starts a process with it off). The check runs
    each partition once on its build inputs beside eager and runs one beyond its delegate's stated
    tolerance on eager, declined with the numbers; turned off, a delegate's wrong answer is
    returned as it is: for a user who has checked the delegate on their model."""
    from torchnative.build import verify

    if bool(enabled) != verify.ENABLED:
        warnings.warn(f"torchnative: the build's check of delegate partitions against eager is "
                      f"{'on' if enabled else 'off'} for programs built from now on", stacklevel=2)
    verify.ENABLED = bool(enabled)


def set_cache_dir(path: str | None) -> None:
    """Where `accelerate()` keeps compiled partitions across processes (default:
    $TORCHNATIVE_CACHE_DIR, else $XDG_CACHE_HOME/torchnative or ~/.cache/torchnative): a directory,
    or an fsspec URL (`s3://bucket/prefix`) that machines share; None turns the cache off. Entries
    are keyed by graph, delegate, toolchain versions and baked weights; a corrupt one is rebuilt."""
    store.set_place(path)

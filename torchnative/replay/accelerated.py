"""The forward of an accelerated module (`torchnative.accelerate`): each call is replayed
(replay/replayer.py) when its guards (replay/guard.py) match a trace seen twice in a row, else
recorded in a session (replay/session.py) that a `Tracer` watches, and the replayer learns what
the recording did.

It is an object in the module's `__dict__`, not a closure: a module that is deep-copied or
pickled (every TTA library copies the model it adapts; a mean teacher copies it again) carries
its own forward, bound to the copy's weights with capture state of its own, never the original's.
"""
from __future__ import annotations

import contextlib
import copy
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import torch

from torchnative import events
from torchnative.cache import calibration as _calibration
from torchnative.cache.program_cache import background, in_call, prepare
from torchnative.recording.scalars import FloatSites
from torchnative.replay.guard import flatten_call, guard_key, same_apart_from_objects
from torchnative.replay.replayer import Replayer, Entry
from torchnative.replay.session import real_outputs, session
from torchnative.replay.hooks import hooks_of, logged
from torchnative.replay.floats import Following
from torchnative.replay.watch import (Submodules, dynamic_floats, foreign_hook, has_dynamic_floats, mode_sets,
                                     module_changes, watch)
from torchnative.replay.trace import Trace
from torchnative.replay.tracer import Tracer
from torchnative.replay.worth import Worth
from torchnative.shim import current_handler


_FUNCTORCH = "a functorch transform (vmap, grad) is active: the call runs as eager"


@dataclass(frozen=True)
class Settings:
    """`accelerate`'s arguments."""
    delegates: tuple[str, ...] | None
    replay: bool
    compile_after: int | None
    quantize: str | None
    background: bool | None = None  # None: program_cache.BACKGROUND
    new_sizes: bool = True  # calls at sizes never seen replay a span's trace (replay/new_sizes.py)


class AcceleratedForward:
    """Records (or replays) each call of `model`'s forward. `original` is the forward it replaces
    when that was not the class's own (an instance attribute); None means the class's, looked up
    on the module each call, so a copy calls its own."""

    def __init__(self, model: torch.nn.Module, original: Callable | None, settings: Settings):
        self.model, self.original, self.settings = model, original, settings
        self._replayer: Replayer | None = None  # made at the first call: a copy's tensors exist only then
        self._sites = FloatSites()  # the floats its calls saw at each site: its own, not another model's
        self._lock = threading.Lock()
        self._listed: tuple[int, Submodules] | None = None  # (module_changes(), submodules) when listed
        self._listed_modes: tuple[tuple, tuple] | None = None  # ((mode_sets(), module_changes()), flags) when listed
        self._worth = Worth()  # whether its calls that do not replay are worth recording

    @property
    def __wrapped__(self) -> Callable:  # inspect.signature (transformers' generate asks it) sees the model's forward
        return self.original if self.original is not None else type(self.model).forward.__get__(self.model)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        s = self.settings
        forward = self.__wrapped__
        with in_call():
            # under a functorch transform (vmap, grad) the call runs as eager: its arguments are the
            # transform's wrappers, which no trace can name, and a graph run at the session's end
            # inside the transform makes values it wraps again (torch.func.grad of the output failed)
            if current_handler() is None and torch._C._are_functorch_transforms_active():
                events.STATS.replay_ineligible[_FUNCTORCH] += 1
                return forward(*args, **kwargs)
            # inside a capture the outer session records; while calibrating every call is recorded
            if s.replay and current_handler() is None and not _calibration.active():
                # one call at a time: the replayer's traces and snapshots are one call's view of the module
                with self._lock:
                    return self._guarded(forward, args, kwargs)
            with session(s.delegates, self._replay_state().weights, compile_after=s.compile_after, quantize=s.quantize,
                         background=s.background, sites=self._sites):
                out = forward(*args, **kwargs)
            return real_outputs(out)  # after the session: its end runs the pending graph

    def _guarded(self, forward: Callable, args: tuple, kwargs: dict) -> Any:
        s, replayer = self.settings, self._replay_state()
        leaves, spec = flatten_call(args, kwargs)
        key = guard_key(self._modes(), leaves, spec, replayer.snapshots)
        started = time.perf_counter()
        # a call with no trace to replay may cost less on eager (replay/worth.py); not a quantized
        # model's: its outputs would be the float model's on some calls
        found = replayer.find(key) if key is not None else None
        # so is a replay of programs that all run on eager: the recorded graph's ops, no fewer than
        # the forward's own, run through its GraphModule; and one autograd records, with its backward
        weighed = key is not None and s.compile_after is None and s.quantize is None and \
            (found is None or _eager_only(found[0]) or _differentiable(found[0]))
        if weighed:
            structure, elements = replayer.structure(key), _elements(leaves)
            if self._worth.eager_next(structure):
                out = forward(*args, **kwargs)
                self._worth.ran_eager(structure, time.perf_counter() - started, elements, out)
                return out
        submodules = self._submodules()
        named = submodules.named
        hooked, hook_set = foreign_hook(submodules), hooks_of(named) if submodules.hooked() else ()
        if hooked is None and found is not None:
            replayed, out = replayer.replay(key, found, leaves, hook_set)
            if replayed:
                if weighed:
                    seconds = time.perf_counter() - started
                    timed = [c.timed for c in found[0].calls if c.timed is not None]
                    self._worth.recorded(structure, seconds, elements, [(t, seconds / len(timed)) for t in timed],
                                         False, out)
                return out
        watch(self.model)  # before the tracer: it counts the call's writes from here
        tracer = Tracer(hook_set)
        before = dict(replayer.snapshots)
        following = Following([self.model, *(m for _, m in named)], dynamic_floats) if has_dynamic_floats() else None
        with session(s.delegates, replayer.weights, tracer, s.compile_after, s.quantize, s.background, sites=self._sites), \
                logged(named, tracer.hooks), following or contextlib.nullcontext() as calc:
            tracer.calc = calc
            out = forward(*args, **kwargs)
        out = real_outputs(out)
        if hooked is not None:
            tracer.refuse(f"{hooked}: Python a replay would skip")
        if key is None:
            tracer.refuse("an argument no guard describes (a module, or a container of another kind)")
        elif not same_apart_from_objects(key, guard_key(self._modes(), leaves, spec, replayer.snapshots)):
            tracer.refuse("the call changed the metadata of an argument tensor")
        learnt = replayer.learn(key, tracer, leaves, out, before)
        if weighed and not _on_the_way_to_a_compiled_replay(learnt):
            self._worth.recorded(structure, time.perf_counter() - started, elements, tracer.costs, tracer.compiling,
                                 out)
        return out

    def _modes(self) -> tuple:
        """The training flags of the model and its submodules, listed again only after a flip."""
        at = (mode_sets(), module_changes())
        if self._listed_modes is None or self._listed_modes[0] != at:
            self._listed_modes = (at, (self.model.training, *(m.training for _, m in self._submodules().named)))
        return self._listed_modes[1]

    def _submodules(self) -> Submodules:
        """The model's submodules, listed again only after a module attribute was set anywhere."""
        changes = module_changes()
        if self._listed is None or self._listed[0] != changes:
            self._listed = (changes, Submodules(self.model))
        return self._listed[1]

    def _replay_state(self) -> Replayer:
        if self._replayer is None:  # buffers are weights too, unless a graph writes them
            self._replayer = Replayer(frozenset(id(b) for b in self.model.buffers()), background(self.settings.background),
                                      self.settings.new_sizes)
        return self._replayer

    def __reduce__(self):
        # pickled as what it is made of: a copy gets a replayer (and lock) of its own
        return AcceleratedForward, (self.model, self.original, self.settings)

    def __deepcopy__(self, memo: dict) -> "AcceleratedForward":
        return AcceleratedForward(copy.deepcopy(self.model, memo), copy.deepcopy(self.original, memo), self.settings)


def _eager_only(trace: Trace, stand_ins: bool = False) -> bool:
    """Do all of the trace's programs run on eager (until their compiles repay; with
    `stand_ins`, or while they compile in the background)?"""
    return bool(trace.calls) and all(c.timed is not None or (stand_ins and c.stands_in is not None)
                                     for c in trace.calls)


def _differentiable(trace: Trace) -> bool:
    """Does a replay of the trace bring a backward of its programs (autograd recorded the call)?"""
    return any(c.differentiable for c in trace.calls)


def _on_the_way_to_a_compiled_replay(entry: Entry | None) -> bool:
    """Is this recorded call one of the two that make a trace of compiled programs replay? Those are
    paid once; weighed against eager, they would start a stretch of eager calls that delays the
    replays they lead to. A trace learnt more often than that does not replay, and is weighed; so
    is one of eager's stand-ins (its replays run eager's program until the compile is done: calls
    at ever new sizes, which record it again and again, may cost more than eager's forward)."""
    return entry is not None and not _eager_only(entry.trace, stand_ins=True) and entry.seen <= 2 and entry.run <= 2


def _elements(leaves: list) -> int:
    """The argument tensors' elements (at least 1): what a call's seconds are divided by."""
    return max(1, sum(x.numel() for x in leaves if isinstance(x, torch.Tensor)))


def _opaque_to_dynamo() -> None:
    """torch.compile over an accelerated model (a user's, or transformers' generate(compile_config=))
    would trace the door itself: it failed on our lazy tensors' shapes, and where it did not it
    recompiled on every call. Dynamo sees the accelerated forward as one opaque call instead. Done
    at the first `accelerate`: importing Dynamo costs 0.8 s, which `import torchnative` should not."""
    if not hasattr(AcceleratedForward.__call__, "_torchdynamo_disable"):
        AcceleratedForward.__call__ = torch.compiler.disable(AcceleratedForward.__call__)


def install(model: torch.nn.Module, delegates: Sequence[str] | None, replay: bool, compile_after: int | None,
            quantize: str | None, background: bool | None, new_sizes: bool = True) -> None:
    """Make `model.forward` an AcceleratedForward (once: a second call changes nothing)."""
    _opaque_to_dynamo()
    if isinstance(model.__dict__.get("forward"), AcceleratedForward):
        return
    original = model.__dict__.get("forward")  # an instance's own forward (another wrapper), kept
    settings = Settings(tuple(delegates) if delegates is not None else None, replay, compile_after, quantize, background,
                        new_sizes)
    model.forward = AcceleratedForward(model, original, settings)
    prepare(settings.delegates, background)


def uninstall(model: torch.nn.Module) -> None:
    """Give `model` back the forward it had before `install`."""
    forward = model.__dict__.get("forward")
    if isinstance(forward, AcceleratedForward):
        del model.__dict__["forward"]
        if forward.original is not None:
            model.forward = forward.original

"""Forward hooks inside an accelerated forward that a replay calls again.

A hook on a submodule (ActMAD's BatchNorm statistics, a feature extractor's list) is Python a
replay would skip. One that only does Python with the tensors it is given (appends them, keeps
them in a dict) can be called by the replay itself, with the values the replayed programs made,
in the order the recording called it. While a call is recorded, each such hook runs through a
`HookLog`, which notes the call or, for a hook that records an op (computes with the tensors:
the graph already holds that work, a second run would repeat it or write twice), returns a
value (replaces the output) or reads data, says why the call cannot replay. Pre-hooks, backward
hooks and global hooks still stop replay (replay/watch.foreign_hook)."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from torchnative.replay.watch import of_the_call
from torchnative.shim.door import current_handler


class HookLog:
    """The forward hooks one recorded call ran: (hook, module, arguments after the module)."""

    def __init__(self) -> None:
        self.calls: list[tuple[Callable, torch.nn.Module, tuple]] = []
        self.why: str | None = None

    def wrap(self, hook: Callable, name: str) -> Callable:
        def logged(module: torch.nn.Module, *args: Any) -> Any:
            handler = current_handler()
            at = getattr(handler, "node", None)
            out = hook(module, *args)
            if out is not None:
                self.refuse(f"the forward hook on submodule {name!r} returns a value (it replaces the output)")
            elif getattr(handler, "node", None) is not at:
                self.refuse(f"the forward hook on submodule {name!r} computes with tensors (its ops are in the graph)")
            else:
                self.calls.append((hook, module, args))
            return out
        return logged

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why


def hooks_of(named: list[tuple[str, torch.nn.Module]]) -> tuple:
    """What a replay's hook calls depend on: each submodule's forward hooks not of the call
    (transformers' own), by identity. A trace replays only while these are the same."""
    return tuple((id(m), tuple(map(id, m._forward_hooks.values()))) for _, m in named
                 if m._forward_hooks and not all(map(of_the_call, m._forward_hooks.values())))


@contextmanager
def logged(named: list[tuple[str, torch.nn.Module]], log: HookLog) -> Iterator[None]:
    """Each submodule's forward hooks (but transformers' own) run through `log` while the block runs."""
    swapped = []
    for name, m in named:
        for k, hook in list(m._forward_hooks.items()) if m._forward_hooks else ():
            if not of_the_call(hook):
                m._forward_hooks[k] = log.wrap(hook, name)
                swapped.append((m._forward_hooks, k, hook))
    try:
        yield
    finally:
        for hooks, k, hook in swapped:
            if k in hooks:  # a hook may remove itself
                hooks[k] = hook

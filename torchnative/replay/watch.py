"""Which modules' attributes a replay depends on: `module_changes()` counts every attribute set
and every parameter or buffer (re)registered on a watched module (one of an accelerated model's):
`bn.momentum = m`, a forward's `self.calls += 1`, `p.data`'s module re-registering. A replayed
trace holds the old tensors and ran with the old Python values, and skips the Python that set
them, so it must not outlive them. A float attribute set to another float between calls is
followed instead (replay/floats.py): its sets after the first do not count as changes; nor do
flips of a module's training flag, which are part of a call's guard key (replay/guard.py).

Module.__setattr__ has no hook of its own: it is wrapped while any module is watched (from the
first `accelerate`), and given back when the last watched module is gone. Setting an attribute to
the object it already holds (`self.model.eval()` on a model in eval mode, at the top of every
forward of many TTA methods) changes nothing and counts nothing. Modules made while a call is
recorded (the fx GraphModules programs are built of) are not watched."""
from __future__ import annotations

import weakref
from typing import Any

import torch

from torchnative.replay.floats import Tracked

_changes = 0
_mode_sets = 0  # sets of a module's training flag to the other value
_float_sets = 0  # sets of dynamic float attributes (replay/floats.py), which do not count as changes
# id -> (weakref, names) of a watched module whose float attributes those names are dynamic: set
# to another float between calls (DUA's momentum)
_dynamic: dict[int, tuple] = {}
# id -> weakref of each watched module: the id alone would match a new module given a freed one's
# id, and a module's own hash may be anything (or nothing)
_watched: dict[int, weakref.ref] = {}
_hooks: list = []  # while any module is watched: the registration hooks' handles
_module_setattr = torch.nn.Module.__setattr__


def _is_watched(module: torch.nn.Module) -> bool:
    ref = _watched.get(id(module))
    return ref is not None and ref() is module


def _bump(module: torch.nn.Module, *_: Any) -> None:
    if _is_watched(module):
        global _changes
        _changes += 1


def _setattr(self: torch.nn.Module, name: str, value: Any) -> None:
    if type(value) is Tracked:
        value = float(value)  # a float replay/floats.py followed: kept as the plain value
    if _is_watched(self):
        old = self.__dict__.get(name, _setattr)
        if old is not value:
            _count(self, name, old, value)
    _module_setattr(self, name, value)


def _count(module: torch.nn.Module, name: str, old: Any, value: Any) -> None:
    global _changes, _float_sets, _mode_sets
    if name == "training" and type(value) is bool and type(old) is bool:
        _mode_sets += 1  # part of the guard key (replay/guard.py), not a change
        return
    names = _dynamic.get(id(module))
    if names is not None and names[0]() is not module:
        names = None
    if names is not None and name in names[1] and type(value) is float:
        _float_sets += 1
        return
    if type(value) is float and isinstance(old, float):
        # from now on its value is followed through recorded calls (replay/floats.py); the
        # traces recorded so far took it as a constant
        if names is None:
            names = _dynamic[id(module)] = (weakref.ref(module, lambda _, i=id(module): _dynamic.pop(i, None)), set())
        names[1].add(name)
    _changes += 1


_setattr.__wrapped__ = _module_setattr


def _install() -> None:
    torch.nn.Module.__setattr__ = _setattr
    _hooks.append(torch.nn.modules.module.register_module_parameter_registration_hook(_bump))
    _hooks.append(torch.nn.modules.module.register_module_buffer_registration_hook(_bump))


def _uninstall() -> None:
    torch.nn.Module.__setattr__ = _module_setattr
    while _hooks:
        _hooks.pop().remove()


def _forget(i: int) -> None:
    _watched.pop(i, None)
    if not _watched and _hooks:
        _uninstall()


def watch(model: torch.nn.Module) -> None:
    """Count attribute writes of `model` and its submodules in `module_changes()`."""
    if not _hooks:
        _install()
    for m in model.modules():
        if not _is_watched(m):
            _watched[id(m)] = weakref.ref(m, lambda _, i=id(m): _forget(i))


def dynamic_floats(module: torch.nn.Module) -> set:
    """The module's float attributes whose values replay/floats.py follows."""
    entry = _dynamic.get(id(module))
    return entry[1] if entry is not None and entry[0]() is module else set()


def has_dynamic_floats() -> bool:
    return bool(_dynamic)


def mode_sets() -> int:
    """How many times a watched module's training flag was flipped."""
    return _mode_sets


def float_sets() -> int:
    """How many times a dynamic float attribute of a watched module was set."""
    return _float_sets


def module_changes() -> int:
    """How many times a watched module had an attribute set or a parameter or buffer (re)registered."""
    return _changes


# hooks whose effects reach the caller only through the call's output, which a replay rebuilds:
# transformers' capture of hidden states and attentions (`output_hidden_states=True`)
_OF_THE_CALL = ("transformers.",)
_KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")
# a submodule's forward hooks a replay calls itself (replay/hooks.py); these it cannot
_UNREPLAYABLE = ("_forward_pre_hooks", "_backward_pre_hooks", "_backward_hooks")


def of_the_call(hook: Any) -> bool:
    return getattr(getattr(hook, "func", hook), "__module__", "").startswith(_OF_THE_CALL)


def _foreign(hooks: dict) -> bool:
    return not all(map(of_the_call, hooks.values()))


class Submodules:
    """A model's submodules, itself excluded (its own hooks run around the forward a replay
    replaces, so they run either way), as listed after the last module attribute was set (a
    module's hook dicts are replaced only by setting it), with every hook dict of theirs: whether
    any holds a hook is one pass over that list in C. Walking a GPT-2's 163 submodules in Python
    (with `hooks_of`) took 31 us of every replayed call; the pass, 11 us."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.named = [(n, m) for n, m in model.named_modules() if m is not model]
        self.hook_dicts = [getattr(m, kind) for _, m in self.named for kind in _KINDS]

    def hooked(self) -> bool:
        """Does any submodule hold a hook of any kind?"""
        return any(self.hook_dicts)


def foreign_hook(submodules: Submodules) -> str | None:
    """Where a hook runs inside a model's forward that a replay would skip and cannot call
    itself (a pre-hook, a backward hook, a global hook), or None. Every call asks."""
    g = torch.nn.modules.module
    if any(_foreign(getattr(g, f"_global{kind}")) for kind in _KINDS):
        return "a global module hook (torch.nn.modules.module.register_module_*_hook)"
    if not submodules.hooked():
        return None
    for name, m in submodules.named:
        if (m._forward_pre_hooks or m._backward_hooks or m._backward_pre_hooks) \
                and any(_foreign(getattr(m, kind)) for kind in _UNREPLAYABLE):
            return f"a hook on submodule {name!r}"
    return None


def watching() -> bool:
    """Is Module.__setattr__ wrapped (some module is watched)?"""
    return bool(_hooks)

"""Python floats that change between calls become scalar inputs of the graph, as torch.compile's
automatic dynamic does for sizes: one graph for a BatchNorm momentum that decays every call (DUA),
not one per value.

A *site* is an op issued by one user instruction with the same other arguments; an *issue* is
its n-th time in one graph. A site whose floats at some issue differ from those that issue had
the first time takes the floats that changed as inputs, at every issue from then on. Issues are
told apart by instruction and count, not by trie position: the first BatchNorm's momentum turning
into an input moves every later BatchNorm (issued by the same instruction) to a trie position
never recorded, which is then an input at once. Factory ops are left alone (`arange`'s length
follows its floats), as is a change that would change the op's output metadata.
"""
from __future__ import annotations

from typing import Any

import torch

from torchnative.lru import Lru
from torchnative.recording.meta import infer
from torchnative.recording.source import user_instruction
from torchnative.recording.trie import is_ref

_FLOAT, _REF = "\0f?", "\0r?"  # a float's and a graph value's place in a site


def _is_float(encoded: Any) -> bool:
    return type(encoded) is str and encoded[:2] == "\0f"


def _shape(encoded: Any, floats: list) -> Any:
    return _FLOAT if floats else _REF if is_ref(encoded) else encoded


class FloatSites:
    """What one owner's calls have seen at each site: an accelerated module keeps its own (two
    copies of one model, a method's and its base's, run the same code with other floats: a
    process-wide table made each one's floats inputs, and its replays ineligible, by the
    other's); `capture()` blocks share the process's (`PROCESS`)."""

    def __init__(self) -> None:
        self.dynamic = Lru(1 << 14, "float sites")  # site -> where its floats that are graph inputs are
        self.first = Lru(1 << 14, "float issues")   # (site, issue) -> its floats the first time

    def forget(self) -> None:
        self.dynamic.clear()
        self.first.clear()

    def dynamic_floats(self, op: Any, args: tuple, kwargs: dict, eargs: tuple, ekw: tuple, issues: dict) -> frozenset:
        """Where `op`'s float arguments that are graph inputs at this issue are (none for most): an
        int for a positional one, the name for a keyword one (`add(x, y, alpha=m)`: a momentum
        public libraries pass by name). `eargs`/`ekw`: the arguments as the recorder encodes them;
        `issues`: the graph's count of issues per site so far, which this updates."""
        floats = [i for i, a in enumerate(eargs) if _is_float(a)] + [k for k, a in ekw if _is_float(a)]
        if not floats or not any(isinstance(a, torch.Tensor) for a in args):
            return frozenset()
        site = (id(op), user_instruction(3), tuple(_shape(a, [i] if i in floats else []) for i, a in enumerate(eargs)),
                tuple((k, _shape(a, [k] if k in floats else [])) for k, a in ekw))
        issue = issues[site] = issues.get(site, -1) + 1
        values = tuple(args[i] if type(i) is int else kwargs[i] for i in floats)
        first = self.first.setdefault((site, issue), values)
        dynamic = self.dynamic.get(site, frozenset())
        changed = {i for i, was, now in zip(floats, first, values) if was != now} - dynamic
        if changed and _same_metas(op, args, kwargs, dict(zip(floats, first))):
            dynamic = self.dynamic[site] = dynamic | changed
        return dynamic


PROCESS = FloatSites()


def forget() -> None:
    PROCESS.forget()


def _same_metas(op: Any, args: tuple, kwargs: dict, before: dict) -> bool:
    """Does `op` make the same output metadata with the floats it had `before`?"""
    old = tuple(before.get(i, a) for i, a in enumerate(args))
    old_kwargs = {k: before.get(k, v) for k, v in kwargs.items()}
    return infer(op, old, old_kwargs)[0] == infer(op, args, kwargs)[0]

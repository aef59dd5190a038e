"""Compiled programs: built once per graph key, cached, run with errors that name the op and the
user's source line."""
from __future__ import annotations

from typing import Callable

import torch
import torch.fx as fx

from torchnative import events
from torchnative.capture.trie import Node, Signature, build_graph
from torchnative.delegates.eager import delegate as eager
from torchnative.ir import CapturedGraph


class CapturedOpError(RuntimeError):
    """An op of a captured graph failed when the graph ran."""


class Program:
    def __init__(self, graph: CapturedGraph):
        self.graph = graph
        self.run_fn: Callable = eager.load(eager.compile(graph))

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        try:
            with torch.no_grad():
                return self.run_fn(inputs)
        except Exception as e:
            raise self._locate(inputs, e) from e

    def _locate(self, inputs: list, error: Exception) -> Exception:
        """Re-run node by node to name the op that failed and where the user issued it."""
        failing: list = []

        class _Finder(fx.Interpreter):
            def run_node(self, n):
                try:
                    return super().run_node(n)
                except Exception:
                    failing.append(n)
                    raise

        try:
            with torch.no_grad():
                _Finder(self.graph.gm).run(*inputs)
        except Exception:
            pass
        if not failing:
            return CapturedOpError(f"captured graph failed: {type(error).__name__}: {error}")
        n = failing[0]
        filename, line = n.meta.get("stack") or ("<unknown>", 0)
        return CapturedOpError(
            f"{n.target} failed in a captured graph (issued at {filename}:{line}): "
            f"{type(error).__name__}: {error}")


_programs: dict = {}


def program_for(node: Node, sig: Signature) -> tuple[Program, bool]:
    key = (node, sig)
    p = _programs.get(key)
    if p is not None:
        events.STATS.cache_hits += 1
        return p, True
    events.STATS.cache_misses += 1
    p = _programs[key] = Program(build_graph(node, sig))
    events.STATS.graphs_built += 1
    return p, False


def clear_caches() -> None:
    """Forget every compiled program, recorded trie path and inferred shape (a cold start)."""
    from torchnative.capture import meta, trie

    _programs.clear()
    trie.ROOT.children.clear()
    meta._cache.clear()

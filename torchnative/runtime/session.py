"""A capture session: the door's handler for one thread, from `capture()` entry to exit."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

from torchnative import events
from torchnative.capture.recorder import Recorder
from torchnative.capture.trie import Node, Signature
from torchnative.delegates import Delegate, resolve
from torchnative.runtime.program import program_for
from torchnative.shim import DoorMode, current_handler, set_handler


def _executor(delegates: tuple[Delegate, ...]):
    def execute(node: Node, sig: Signature, inputs: list, n_ops: int) -> list:
        program, hit = program_for(node, sig, delegates, inputs)
        values = program(inputs)
        events.STATS.graph_runs += 1
        events.emit(events.GraphRun(program.graph, hit, n_ops, program.partitions))
        return values
    return execute


@contextmanager
def session(delegates: Sequence[str] | None = None, weights: frozenset[int] = frozenset()) -> Iterator[Recorder | None]:
    """`weights`: ids of real tensors to treat as weights (`param` role), e.g. module buffers."""
    outer = current_handler()
    if isinstance(outer, Recorder):  # nested: the outer session records; its end is a cut
        yield outer
        outer.flush()
        return
    mode = DoorMode()
    recorder = Recorder(_executor(resolve(delegates)), mode, weights)
    previous = set_handler(recorder)
    try:
        with mode:
            yield recorder
    finally:
        try:
            recorder.flush()
        finally:
            set_handler(previous)

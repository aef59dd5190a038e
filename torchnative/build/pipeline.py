"""The stages from a captured graph to a program, in order, each an artifact of its own (as
ExecuTorch's `partition` → `preprocess`): the passes prepare the graph (`passes.prepare`), the
partitioner plans and lowering compiles each partition (`build.lower` → `LoweredGraph`),
loading makes runners (`build.runners` → steps), and `Program` assembles them."""
from __future__ import annotations

import functools
import time
from typing import Sequence

import torch

from torchnative import events
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Delegate
from torchnative.ir import CapturedGraph
from torchnative.partitioner import EAGER
from torchnative.passes import prepare
from torchnative.build.runners import runners
from torchnative.build.lower import lower
from torchnative.build.program import Program, Step
from torchnative.build import verify as verification
from torchnative.build import disk_cache
from torchnative.build.verify import Verdict, check, declined, reference, tolerance_of
from torchnative.sizes import narrowest
from torchnative.build.differentiable import Differentiable


def build_program(captured: CapturedGraph, delegates: Sequence[Delegate], inputs: list[torch.Tensor],
                  quantize: str | None = None, keep_artifacts: bool = False,
                  calibration_sets: Sequence[list[torch.Tensor]] = (), verify: bool | None = None) -> Program:
    """`inputs`: the captured graph's placeholders' values; `keep_artifacts`: each step keeps its
    delegate's artifact, to be saved in a bundle; `calibration_sets`: more sets of inputs, for
    delegates that calibrate on values; `verify`: each delegate partition checked against eager
    on these inputs, and run on eager if it is beyond its delegate's tolerance (build/verify.py;
    None: unless TORCHNATIVE_VERIFY=0)."""
    started = time.perf_counter()
    graph, derived = prepare(captured, inputs, quantize, eager_only=all(d is eager for d in delegates))
    inputs = inputs + derived.tensors
    lowered = lower(graph, delegates, inputs, [c + derived.tensors for c in calibration_sets])
    steps = runners(lowered, graph.key, keep_artifacts)
    if not steps:  # no partitions: the graph runs on eager as it is
        placeholders = graph.placeholders()
        steps = [Step(EAGER, graph, placeholders, placeholders, graph.outputs(), eager.load(eager.compile(graph)))]
    verify_s = _verified(graph, inputs, steps, lowered.delegates) if (verification.ENABLED if verify is None else verify) else 0.0
    program = Program(captured, graph, steps, derived.tensors, sorted(_baked(graph, steps) | derived.sources),
                      inputs, lowered.declined, _ranges(lowered, "ranges"), _ranges(lowered, "bounds"))
    program.verify_s = verify_s
    program.make_differentiable = functools.partial(Differentiable, captured, tuple(delegates), build_program)
    events.emit(events.ProgramBuilt(program, time.perf_counter() - started))
    return program


def _verified(graph: CapturedGraph, inputs: list, steps: list[Step], delegates: dict) -> float:
    """Each delegate step checked against eager on the build inputs; one beyond its delegate's
    tolerance is replaced by its partition on eager. An artifact from the disk cache keeps the
    verdict it had when first built (no eager run for it again). The seconds it took."""
    if all(s.delegate == EAGER for s in steps):
        return 0.0
    started = time.perf_counter()
    ref = None
    for i, s in enumerate(steps):
        if s.delegate == EAGER:
            continue
        verdict = _stored_verdict(s.entry)
        if verdict is None:
            ref = ref or reference(graph, inputs, {n for t in steps if t.delegate != EAGER for n in (*t.inputs, *t.outputs)})
            verdict = check(s, ref, tolerance_of(delegates[s.delegate], s.graph))
            if s.entry:
                disk_cache.put_verdict(s.entry, verdict.stored())
        s.verdict = verdict
        if not verdict.ok:
            declined(s.delegate, verdict, graph.key, s.n_ops())
            steps[i] = Step(EAGER, s.graph, s.reads, s.reads, s.outputs, eager.load(eager.compile(s.graph)),
                            s.compile_s, verdict=verdict)
    return time.perf_counter() - started


def _stored_verdict(entry: str | None) -> Verdict | None:
    stored = disk_cache.get_verdict(entry) if entry else None
    try:
        return Verdict.from_stored(stored) if stored is not None else None
    except (KeyError, TypeError, ValueError):  # a verdict file of another shape: checked again
        return None


def _ranges(lowered, kind: str) -> dict[int, tuple[int, int]]:
    """The symbols' ranges the partitions' artifacts take, where narrower than their rules':
    "ranges" what the graph itself takes (torch.export found), "bounds" the sizes a program was
    built for (sizes.bucket)."""
    return narrowest(*(getattr(part.artifact, kind) for part in lowered.partitions if part.artifact))


def _baked(graph: CapturedGraph, steps: list[Step]) -> set[int]:
    """The params a delegate compiled into its artifact: the program holds only while they do not change."""
    index = {n: i for i, n in enumerate(graph.placeholders())}
    return {index[n] for s in steps if s.delegate != EAGER for n in s.reads
            if n in index and graph.input_roles[index[n]] == "param"}

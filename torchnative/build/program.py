"""A compiled program: a prepared graph's partitions, each with its delegate's loaded runner, run
in order with eager's output layouts; a partition whose delegate fails at run time falls back to
eager (counted, reported), and an error names the op and the user's source line. Built by
`build.pipeline`, cached by `cache.program_cache`."""
from __future__ import annotations

import functools
import time
import weakref
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.fx as fx

from torchnative import events
from torchnative.grad import no_grad, version, writes
from torchnative.delegates.eager import delegate as eager
from torchnative.interface import Artifact
from torchnative.ir import CapturedGraph
from torchnative.partitioner import EAGER
from torchnative.sizes import SIZES, dense_order, dense_strides, narrowest, symbol_sources


class CapturedOpError(RuntimeError):
    """An op of a captured graph failed when the graph ran. The error raised is also an instance of
    the op's own exception's type (`except IndexError:` around a call catches a token id past the
    vocabulary, as it does in eager), where Python can combine the two types."""


_OF_KIND: dict[type, type] = {}  # the op's exception type -> its CapturedOpError


def captured_op_error(message: str, cause: BaseException) -> CapturedOpError:
    """A CapturedOpError saying `message` that is also of `cause`'s type."""
    return _of_kind(type(cause))(message)


def _of_kind(kind: type) -> type:
    if issubclass(CapturedOpError, kind) or issubclass(kind, CapturedOpError) or not issubclass(kind, Exception):
        return CapturedOpError
    if kind not in _OF_KIND:
        try:  # BaseException's str and init, not the kind's (a KeyError would quote the message)
            _OF_KIND[kind] = type(f"CapturedOpError[{kind.__name__}]", (CapturedOpError, kind),
                                  {"__str__": BaseException.__str__, "__init__": BaseException.__init__,
                                   "__reduce__": _reduce, "__module__": __name__})
        except TypeError:  # a kind with its own instance layout (OSError, AttributeError)
            _OF_KIND[kind] = CapturedOpError
    return _OF_KIND[kind]


def _reduce(error: CapturedOpError) -> tuple:
    # a type made by type() pickles as what makes it again (an error sent back by a worker process)
    kind = next(k for k in type(error).__bases__ if k is not CapturedOpError)
    return _remade, (str(error), kind)


def _remade(message: str, kind: type) -> CapturedOpError:
    return _of_kind(kind)(message)


def baked_state(t: torch.Tensor) -> tuple[int, int, int]:
    """What a tensor a program baked in must still be: not written in place (its version), not
    written as state by a captured graph (which leaves the version as eager's kernels do:
    BatchNorm's running stats in train mode), and not given other memory (`p.data = new`,
    `set_`: the version does not move; delegates that take weights by address, as ONNX Runtime
    does, would read the old memory). An inference tensor has no version (passes/pin.py never
    lets one be baked)."""
    return version(t), writes(t), t.data_ptr()


@dataclass
class Step:
    """One partition: which graph values it reads (all, and those passed at run time: a delegate
    bakes params in), which it writes, its loaded runner, and what compiling it cost."""
    delegate: str
    graph: CapturedGraph | None  # None: loaded from a bundle, which keeps no graph
    reads: list[fx.Node]
    inputs: list[fx.Node]
    outputs: list[fx.Node]
    run: Callable
    compile_s: float = 0.0
    artifact_bytes: int = 0
    artifact: Artifact | None = None  # kept only for a program built to be saved (a bundle)
    label: str = ""  # what an error names it by, for a loaded step (its partition and file)
    ops: int = 0  # a loaded step's op count (a built one's is its graph's)
    verdict: Any = None  # build/verify.py's: its gap from eager when built (a declined one runs on eager)
    entry: str | None = None  # the disk cache entry its artifact came from or went to (its verdict is kept beside)

    def n_ops(self) -> int:
        return len(self.graph.op_nodes()) if self.graph is not None else self.ops


class WrongOutput(RuntimeError):
    """A partition returned a value of another shape or dtype than eager makes."""


def _layout(n: fx.Node) -> tuple:
    """The layout eager gives a value: its shape, strides and dtype, or, for a value whose size
    varies (torchnative.sizes), None, the order its dims are dense in (None too when it is a
    view) and its dtype."""
    val = n.meta["val"]
    if SIZES not in n.meta:
        return val.shape, val.stride(), val.dtype
    return None, dense_order(tuple(val.shape), val.stride()), val.dtype


def _eager_layout(value: torch.Tensor, shape: tuple | None, want: tuple | None, dtype: torch.dtype) -> torch.Tensor:
    """A partition's output with the strides eager would have given it (`want`, for a value of
    `shape`; with no shape, `want` is the order of dims eager lays it out densely in): later eager
    ops (view after permute of SDPA's output) and the user can depend on them. A value of another
    shape or dtype than eager's is a delegate's error, raised (`WrongOutput`)."""
    if value.dtype != dtype or (shape is not None and value.shape != shape):
        raise WrongOutput(f"returned {str(value.dtype).removeprefix('torch.')}{list(value.shape)} for a value eager "
                          f"makes as {str(dtype).removeprefix('torch.')}{list(shape) if shape is not None else ''}")
    if shape is None:
        if want is None:
            return value
        shape, want = value.shape, dense_strides(tuple(value.shape), want)
    stride = value.stride()
    if stride == want or value.numel() <= 1 or 0 in want:
        return value  # an expanded layout (stride 0) cannot be written into: dense values stay dense
    if all(a == b for a, b, n in zip(stride, want, shape) if n != 1):
        return value  # the strides differ only on size-1 dims, which address nothing (a decode step's k/v rows)
    return torch.empty_strided(shape, want, dtype=value.dtype).copy_(value)


# Observers of partition runs (the inspector's numeric check): each is called as
# `around(program, index, step, inputs, run) -> outputs` in place of `run(inputs)` for every
# partition a program runs, so the inspector watches without touching a program's runners. Empty
# (the default), programs run as they are.
AROUND: list[Callable] = []


class Program:
    # a program of one size that a template's program now runs too (ProgramCache._retire_covered):
    # never valid again, so the traces that hold it record and take that one, and its runtime's
    # weights are let go
    retired = False

    def __init__(self, captured: CapturedGraph, graph: CapturedGraph, steps: list[Step], extra: list[torch.Tensor],
                 baked: list[int], inputs: list[torch.Tensor], declined: tuple = (), ranges: dict | None = None,
                 bounds: dict | None = None):
        """`captured`: the graph as recorded, what a program for other delegates is built from;
        `graph`: as the passes prepared it, which `steps` run; `extra`: constants the passes
        computed, appended to every call's inputs; `baked`: the indices of `inputs` (the
        prepared graph's, `extra` included) that a delegate baked in or a pass computed from;
        `declined`: (op, delegate, reason) of every node a delegate declined; `ranges`: symbol ->
        the range its delegates' artifacts take, where narrower than the graph's rules say
        (torchnative.sizes); `bounds`: narrower still, the sizes this program was built for (a
        program per bucket, sizes.bucket), which `valid_for` checks."""
        self.captured, self.graph, self.steps, self.extra, self.declined = captured, graph, steps, extra, declined
        self.verify_s = 0.0  # seconds the build spent checking its partitions against eager
        self._differentiable = None  # build/differentiable.py's form, made at the first replay autograd records
        self.make_differentiable: Callable | None = None  # how to make it (set by the pipeline)
        self.ranges = ranges or {}
        self.bounds = narrowest(self.ranges, bounds or {})
        sources = symbol_sources(captured.placeholders())
        self._bounded = [(*sources[j], lo, hi) for j, (lo, hi) in self.bounds.items()]
        self.baked = [(i, weakref.ref(inputs[i]), baked_state(inputs[i])) for i in baked]
        # their memory, held: another tensor given it (a new weight of the same size, after `p.data =`
        # freed this one's) would pass a check of its address
        self._held = [inputs[i].untyped_storage() for i in baked]
        self._placeholders, self._outputs = graph.placeholders(), graph.outputs()
        whole = len(steps) == 1 and steps[0].graph is graph  # no partitions: the graph runs as it is
        self.run_fn: Callable = steps[0].run if whole else self._run_steps
        self._count()
        self._index()

    @classmethod
    def assembled(cls, steps: list[Step], n_inputs: int, args: list[list[int]], results: list[int],
                  layouts: list[list[tuple]]) -> "Program":
        """A program of loaded runners whose plan is given, not derived from a graph (a bundle's:
        bundle/load.py): `args[i]` are step i's argument positions in the values a run builds
        (the `n_inputs` inputs, then each step's outputs in turn), `results` the program's
        outputs' positions, `layouts[i]` the (shape, strides, dtype) of step i's outputs, each
        step's checked and laid out as eager's (a bundle holds no graph to fall back to)."""
        p = cls.__new__(cls)
        p.captured = p.graph = None
        p.steps, p.extra, p.declined, p.ranges, p.bounds = steps, [], (), {}, {}
        p.baked, p._held, p._bounded, p.verify_s = [], [], [], 0.0
        p._n_inputs, p._args, p._results, p._layouts = n_inputs, args, results, layouts
        p._relaid = set(range(len(steps)))
        p.run_fn = p._run_steps
        p._count()
        return p

    def stale(self) -> bool:
        """A baked param is gone or has changed since: this program can never run again."""
        return any((t := ref()) is None or baked_state(t) != state for _, ref, state in self.baked)

    def valid_for(self, inputs: list[torch.Tensor]) -> bool:
        """Baked params must be the same tensors, unchanged since they were baked; sizes within
        the program's bounds; not retired (ProgramCache._retire_covered)."""
        if self.retired:
            return False
        for i, ref, state in self.baked:
            if inputs[i] is not ref() or baked_state(inputs[i]) != state:
                return False
        return all(lo <= (inputs[k].shape[d] - r.const) // r.coef <= hi for k, d, r, lo, hi in self._bounded)

    def changed(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        """Baked params that are the same tensors as when baked, written or given other memory since
        (updated at test time: an EMA teacher's `p.data = ...`)."""
        return [inputs[i] for i, ref, state in self.baked if inputs[i] is ref() and baked_state(inputs[i]) != state]

    def _count(self) -> None:
        """(delegate, ops) per step, kept: every run's GraphRun event carries it."""
        self.partitions = tuple((s.delegate, s.n_ops()) for s in self.steps)

    def _index(self) -> None:
        """Where each step's arguments are in the list of values a run builds (the inputs, then
        each step's outputs in turn), where the program's outputs are, and each delegate output's
        eager layout: a run looks these up by position (a decode step's program has ~200 inputs)."""
        at = {n: k for k, n in enumerate(self._placeholders)}
        for s in self.steps:
            at.update((n, len(at)) for n in s.outputs)
        self._n_inputs = len(self._placeholders)
        self._args = [[at[n] for n in s.inputs] for s in self.steps]
        self._results = [at[n] for n in self._outputs]
        self._layouts = [[_layout(n) for n in s.outputs] for s in self.steps]
        self._relaid = {i for i, s in enumerate(self.steps) if s.delegate != EAGER}

    def _run_steps(self, inputs: list[torch.Tensor], timed: bool = False) -> list[torch.Tensor]:
        """The one loop over a program's partitions: each on its arguments, its outputs checked
        and laid out as eager's; a delegate's partition that fails where eager does not runs on
        eager from then on (counted, reported), a loaded one's failure is raised naming it."""
        if len(inputs) != self._n_inputs:  # values are found by position: a list of another length misplaces all
            raise ValueError(f"a program of {self._n_inputs - len(self.extra)} inputs was given "
                             f"{len(inputs) - len(self.extra)}")
        values = list(inputs)
        for i, step in enumerate(self.steps):
            started = time.perf_counter() if timed else 0.0
            try:
                args = [values[k] for k in self._args[i]]
                outs = step.run(args) if not AROUND else _around(self, i, step, args, step.run)
                if i in self._relaid:
                    outs = [_eager_layout(v, *layout) for v, layout in zip(outs, self._layouts[i])]
            except Exception as e:
                if step.graph is None:
                    raise captured_op_error(f"{step.label} failed: {type(e).__name__}: {e}", e) from e
                if step.delegate == EAGER:
                    raise
                failed = step.delegate, step.inputs, step.run
                step.delegate, step.inputs, step.run = EAGER, step.reads, eager.load(eager.compile(step.graph))
                self._index()
                try:
                    outs = step.run([values[k] for k in self._args[i]])
                except Exception:
                    # eager fails on these values too (a token id past the vocabulary): the call's
                    # input is at fault, not the delegate, which keeps the partition
                    step.delegate, step.inputs, step.run = failed
                    self._index()
                    raise
                events.fallback(failed[0], f"run failed: {type(e).__name__}: {e}", self.graph.key, step.n_ops())
                self._count()
            if timed:
                events.emit(events.PartitionRun(step, self.graph.key if self.graph is not None else "", i, started,
                                                time.perf_counter() - started))
            values += outs
        return [values[k] for k in self._results]

    def differentiable(self, inputs: list[torch.Tensor], submit: Callable | None = None) -> list[torch.Tensor] | None:
        """The captured graph on `inputs` with autograd's backward (build/differentiable.py): what a
        replayed call that autograd records runs; None while `submit` makes it off the call."""
        if self._differentiable is None:
            if self.make_differentiable is None:
                raise RuntimeError("this program was not built by the pipeline: it has no differentiable form")
            self._differentiable = self.make_differentiable()
        return self._differentiable(inputs, submit)

    def __call__(self, inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        if self.extra:
            inputs = inputs + self.extra
        try:
            with no_grad():
                if events.timing or AROUND:
                    return self._run_steps(inputs, timed=events.timing)
                return self.run_fn(inputs)
        except CapturedOpError:
            raise
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
            return captured_op_error(f"captured graph failed: {type(error).__name__}: {error}", error)
        n = failing[0]
        filename, line = n.meta.get("stack") or ("<unknown>", 0)
        return captured_op_error(
            f"{n.target} failed in a captured graph (issued at {filename}:{line}): "
            f"{type(error).__name__}: {error}", error)


def _around(program: Program, i: int, step: Step, args: list, run: Callable) -> list:
    for observer in AROUND:
        run = functools.partial(observer, program, i, step, run=run)
    return run(args)

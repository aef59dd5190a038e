"""A program's graph with its backward, for calls autograd records.

A call recorded under autograd (a training-mode TTA forward: its parameters require grad) builds
autograd's graph op by op above the door, tens of µs an op. A replay runs none of the call's ops,
so it must bring the backward itself: AOTAutograd (the backward torch.compile uses) traces the graph
as recorded (every op with its derivative) into a forward that also returns what the backward
needs, and the backward graph, joined in one autograd.Function whose outputs carry that backward,
so gradients reach the parameters as eager's do. Each of the two graphs is built into a program
for the delegates of the program it came from, checked against eager like any other; on eager
alone they run as traced, and the result is eager's bit for bit.

Tracing and building run where compiles run (off the call, by default): tracing is not safe beside
another thread's export, and takes seconds. Until the form is ready the call is recorded, as before.
"""
from __future__ import annotations

import copy
import time
from concurrent.futures import Future
from typing import Callable, Sequence

import torch
import torch.fx as fx

from torchnative import events
from torchnative.interface import Delegate
from torchnative.ir import CapturedGraph


def _captured(gm: fx.GraphModule) -> tuple[CapturedGraph, list[int]]:
    """AOTAutograd's graph as ours: every placeholder an input (the weights change every step),
    its fake values as meta tensors, the source lines it has not, and only the outputs that are
    values; with the positions of those that are None (the gradients of inputs that need none)."""
    g = copy.deepcopy(gm)
    for n in g.graph.nodes:
        v = n.meta.get("val")
        if isinstance(v, torch.Tensor):
            n.meta["val"] = torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        n.meta.setdefault("stack", ("<backward>", 0))
    placeholders = [n for n in g.graph.nodes if n.op == "placeholder"]
    output = next(n for n in g.graph.nodes if n.op == "output")
    values = list(output.args[0])
    nones = [i for i, v in enumerate(values) if v is None]
    output.args = ([v for v in values if v is not None],)
    g.recompile()
    return CapturedGraph(g, ["input"] * len(placeholders), ["output"] * (len(values) - len(nones))), nones


# a backward compiled with donated buffers refuses retain_graph, which eager allows; the flag is
# read where AOTAutograd compiles and again where its backward runs
def _no_donated_buffers():
    return torch._functorch.config.patch(donated_buffer=False)


# runs of a built program and of its graph on eager, alternated, before the faster is kept
_TRIALS = 3


class _Built:
    """One of AOTAutograd's graphs (forward or backward) as a program for `delegates`. Its first
    run (the tracing run: it needs values) runs the graph as traced and keeps its inputs; `build`
    then builds the program on them, outside AOTAutograd's autograd.Function (an export inside
    one meets its functionalization).

    The built program is not always the faster: a backward whose convolution_backward ops run on
    eager between ONNX Runtime partitions (RT-DETR's, 57 of them) took twice eager autograd's time.
    Its first runs alternate between the program and the graph on eager, timed, and the faster is
    kept (a slower program is a fallback in stats(), with both times)."""

    def __init__(self, gm: fx.GraphModule, delegates: Sequence[Delegate], build: Callable, what: str):
        self.gm, self.delegates, self._build, self.what = gm, delegates, build, what
        self.program: Callable | None = None
        self.examples: list | None = None
        self.nones: list[int] = []
        self.times: tuple[list[float], list[float]] | None = None  # (program's, eager's) while on trial
        self.slower = False  # the program, timed against the graph on eager: it runs on eager
        self._boxed_call = True

    def __call__(self, args: list) -> list:
        args = list(args)  # AOTAutograd's boxed convention clears the list it passes
        if self.program is None:
            if self.examples is None:
                self.examples = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return list(self.gm(*args))
        if self.times is None:
            return list(self.gm(*args)) if self.slower else self._run(args)
        ours, eager = self.times
        started, on_program = time.perf_counter(), len(ours) <= len(eager)
        values = self._run(args) if on_program else list(self.gm(*args))
        (ours if on_program else eager).append(time.perf_counter() - started)
        if len(eager) == _TRIALS:
            self._choose(min(ours), min(eager))
        return values

    def _run(self, args: list) -> list:
        values = self.program(args)
        for i in self.nones:
            values.insert(i, None)
        return values

    def _choose(self, ours: float, eager: float) -> None:
        self.times, self.slower = None, ours > eager
        if self.slower:
            events.fallback("replay", f"the {self.what}'s program took {ours * 1e3:.1f} ms, its graph on eager "
                                      f"{eager * 1e3:.1f} ms: it runs on eager", "", len(self.gm.graph.nodes))

    def build(self) -> None:
        if self.program is None and self.examples is not None:
            graph, self.nones = _captured(self.gm)
            self.program, self.examples = self._build(graph, self.delegates, self.examples), None
            self.times = ([], [])


class Differentiable:
    """`graph` as a function of its placeholders' values whose outputs autograd can differentiate."""

    def __init__(self, graph: CapturedGraph, delegates: Sequence[Delegate], build: Callable):
        """`build(graph, delegates, inputs)`: the pipeline's build_program."""
        from functorch.compile import aot_function, make_boxed_func

        from torchnative.delegates.eager import delegate as eager

        gm = graph.gm
        self._graph = gm
        self._made: list[_Built] = []

        def compile(g: fx.GraphModule, example_inputs: list) -> Callable:
            if all(d is eager for d in delegates):
                return make_boxed_func(g.forward)
            self._made.append(_Built(g, delegates, build, "backward" if self._made else "forward"))
            return self._made[-1]

        def forward(*inputs: torch.Tensor) -> tuple:
            return tuple(gm(*inputs))

        self._run = aot_function(forward, fw_compiler=compile, bw_compiler=compile)
        self._reach: list[frozenset[int]] = []  # per output: the inputs eager's backward reaches from it
        # the state the run's values are written into (BatchNorm's running statistics), which the
        # backward may keep (native_batch_norm_backward takes them): a copy, so the write after the
        # run leaves what it keeps as it was
        self._state = sorted(set(graph.writes))
        self._ready, self._failed = False, False
        self._job: Future | None = None
        self._key, self._n_ops = graph.key, len(graph.op_nodes())

    def programs(self) -> list:
        """The programs built of its forward and backward graphs (none on eager alone)."""
        return [b.program for b in self._made if b.program is not None]

    def _prepare(self, examples: list[torch.Tensor]) -> None:
        """Trace and build, forward and backward (AOTAutograd compiles the backward at its first
        run), by running once on `examples` (the values and gradients dropped)."""
        with torch.enable_grad(), _no_donated_buffers():
            self._reach = _reach(self._graph(*examples), examples)
            outs = [o for o in self._run(*examples) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])
        for built in self._made:
            built.build()
        self._ready = True

    def __call__(self, inputs: list[torch.Tensor], submit: Callable[..., Future] | None = None) -> list | None:
        """The outputs, carrying the backward; None while it is being made off the call (`submit`
        runs a job there; None: made in the call), and for good if it could not be made (an op
        AOTAutograd cannot differentiate: the calls go on recording, as eager runs them)."""
        if not self._ready:
            if self._failed:
                return None
            if self._job is None:
                examples = [_example(t) for t in inputs]
                self._job = submit(self._prepare, examples) if submit is not None else _done(self._prepare, examples)
            if not self._job.done():
                return None
            if self._job.exception() is not None:
                e = self._job.exception()
                self._failed = True
                events.fallback("replay", f"no backward for its graph: {type(e).__name__}: {e}", self._key, self._n_ops)
                return None
        if self._state:
            inputs = list(inputs)
            for i in self._state:
                inputs[i] = inputs[i].clone()
        return list(_AsEager.apply(self._run, self._reach, *inputs))


class _AsEager(torch.autograd.Function):
    """AOTAutograd's function, with eager's gradients where no gradient reaches: its one autograd
    node joins every input to every output, so an output the loss never reads (ActMAD's logits)
    would send zeros to the weights only it depends on, where eager leaves their `.grad` None (an
    optimizer with weight decay then moves them, and a weight baked into a program is found
    written). The backward asks the inner function for the gradients of the outputs that got one,
    and gives None to every input that eager's graph does not reach from those (`_reach`)."""

    @staticmethod
    def forward(ctx, run: Callable, reach: list, *inputs: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
        with torch.enable_grad():
            outs = run(*leaves)
        # saved, not kept on ctx: autograd frees the inner graph after a backward without retain_graph
        values = [*leaves, *outs]
        ctx.save_for_backward(*[v for v in values if isinstance(v, torch.Tensor)])
        ctx.values, ctx.n, ctx.reach = [None if isinstance(v, torch.Tensor) else v for v in values], len(leaves), reach
        ctx.mark_non_differentiable(*[o for o in outs if isinstance(o, torch.Tensor) and not o.requires_grad])
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        tensors = iter(ctx.saved_tensors)
        values = [next(tensors) if v is None else v for v in ctx.values]
        leaves, outs = values[:ctx.n], values[ctx.n:]
        given = [k for k, g in enumerate(grads) if g is not None and getattr(outs[k], "requires_grad", False)]
        reached = frozenset().union(*[ctx.reach[k] for k in given])
        wanted = [i for i in sorted(reached) if leaves[i].requires_grad]
        result: list = [None] * len(leaves)
        if given and wanted:
            # the inner graph kept as the user's backward keeps the outer one (retain_graph)
            with _no_donated_buffers():
                got = torch.autograd.grad([outs[k] for k in given], [leaves[i] for i in wanted],
                                          [grads[k] for k in given],
                                          retain_graph=torch._C._autograd._get_current_graph_task_keep_graph(),
                                          create_graph=torch.is_grad_enabled(), allow_unused=True)
            for i, g in zip(wanted, got):
                result[i] = g
        return (None, None, *result)


def _reach(outs: Sequence, inputs: Sequence) -> list[frozenset[int]]:
    """Per output of a graph run eagerly on `inputs` (leaves), the inputs its autograd graph reaches."""
    slot = {id(x): i for i, x in enumerate(inputs) if isinstance(x, torch.Tensor)}
    reach = []
    for o in outs:
        found: set[int] = set()
        if isinstance(o, torch.Tensor) and o.requires_grad:
            stack, seen = [o.grad_fn], set()
            if o.grad_fn is None and id(o) in slot:  # an input returned as it is
                found.add(slot[id(o)])
            while stack:
                node = stack.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                variable = getattr(node, "variable", None)  # AccumulateGrad: a leaf
                if variable is not None and id(variable) in slot:
                    found.add(slot[id(variable)])
                stack.extend(n for n, _ in node.next_functions)
        reach.append(frozenset(found))
    return reach


def _done(fn: Callable, *args) -> Future:
    """`fn(*args)` run here, as a finished Future."""
    job: Future = Future()
    try:
        job.set_result(fn(*args))
    except Exception as e:  # noqa: BLE001 -- kept in the Future, as a job off the call keeps it
        job.set_exception(e)
    return job


def _example(t: torch.Tensor) -> torch.Tensor:
    """A tensor like `t`, detached from the caller's graph, that requires grad where `t` does."""
    return t.detach().clone().requires_grad_(t.requires_grad) if isinstance(t, torch.Tensor) else t

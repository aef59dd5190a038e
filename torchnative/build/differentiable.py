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
from torchnative.delegates.base import traced
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
        if self.slower:
            return list(self.gm(*args))
        if self.program is None:
            if self.examples is None:
                self.examples = [a.detach().clone() if isinstance(a, torch.Tensor) else a for a in args]
            return list(self.gm(*args))
        if self.times is None:
            return self._run(args)
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
            self.program = None  # never run again: its runtimes and their memory let go
            events.fallback("replay", f"the {self.what}'s program took {ours * 1e3:.1f} ms, its graph on eager "
                                      f"{eager * 1e3:.1f} ms: it runs on eager", "", len(self.gm.graph.nodes))

    def build(self) -> None:
        if self.program is None and self.examples is not None:
            graph, self.nones = _captured(self.gm)
            self.program, self.examples = self._build(graph, self.delegates, self.examples), None
            self.times = ([], [])


class _Form:
    """AOTAutograd's function of the graph, its outputs outside `kept` detached (None: none): its
    forward saves, and its backward computes, what the gradients of the kept outputs need only."""

    def __init__(self, gm: fx.GraphModule, kept: frozenset[int] | None, delegates: Sequence[Delegate], build: Callable):
        from functorch.compile import aot_function, make_boxed_func

        from torchnative.delegates.eager import delegate as eager

        self.kept = kept
        self.made: list[_Built] = []
        self.ready, self.failed = False, False
        self.job: Future | None = None

        def compile(g: fx.GraphModule, example_inputs: list) -> Callable:
            if all(d is eager for d in delegates):
                return make_boxed_func(g.forward)
            self.made.append(_Built(g, delegates, build, "backward" if self.made else "forward"))
            return self.made[-1]

        def forward(*inputs: torch.Tensor) -> tuple:
            return tuple(o.detach() if kept is not None and k not in kept and isinstance(o, torch.Tensor) else o
                         for k, o in enumerate(gm(*inputs)))

        self.run = aot_function(forward, fw_compiler=compile, bw_compiler=compile)

    def prepare(self, examples: list[torch.Tensor]) -> None:
        """Trace and build, forward and backward (AOTAutograd compiles the backward at its first
        run), by running once on `examples` (the values and gradients dropped). The tracing is the
        process's one trace at a time: a kept form, asked for after the calls stopped waiting for
        compiles, traced in the background beside an export on the caller's thread, and fx's
        process-wide proxy state failed both and every trace after ("s22 is not tracked with
        proxy")."""
        traced(self._trace, examples)
        for built in self.made:
            built.build()
        self.ready = True

    def _trace(self, examples: list[torch.Tensor]) -> None:
        with torch.enable_grad(), _no_donated_buffers():
            outs = [o for o in self.run(*examples) if isinstance(o, torch.Tensor) and o.requires_grad]
            if outs:
                torch.autograd.backward(outs, [torch.ones_like(o) for o in outs])


# forms kept per graph besides the full one: the sets of outputs a loss reads are few
_KEPT_FORMS = 2


class Differentiable:
    """`graph` as a function of its placeholders' values whose outputs autograd can differentiate.

    Its backward computes the gradients of the outputs that get one. ActMAD's loss reads the
    BatchNorm features its hooks collect, not the logits: AOTAutograd's backward of every output
    ran RT-DETR's decoder backward on zero gradients, which eager autograd never runs (its graph on
    eager 20.7 ms against eager's whole backward 17.9). Once two backwards in a row got gradients
    for the same outputs, calls run a form of the graph whose other outputs are detached
    (`_Form`); an output outside it that gets a gradient after all is differentiated through the
    full form, run again on the saved inputs (autograd's own check of the inputs' versions holds)."""

    def __init__(self, graph: CapturedGraph, delegates: Sequence[Delegate], build: Callable):
        """`build(graph, delegates, inputs)`: the pipeline's build_program."""
        self._graph, self._delegates, self._build = graph.gm, delegates, build
        self._forms: dict[frozenset[int] | None, _Form] = {None: _Form(graph.gm, None, delegates, build)}
        self._reach: list[frozenset[int]] = []  # per output: the inputs eager's backward reaches from it
        self._grads: list[bool] = []  # per output: does it require grad
        self._given: tuple[frozenset[int] | None, frozenset[int] | None] = (None, None)  # the last two backwards'
        # the state the run's values are written into (BatchNorm's running statistics), which the
        # backward may keep (native_batch_norm_backward takes them): a copy, so the write after the
        # run leaves what it keeps as it was
        self._state = sorted(set(graph.writes))
        self._key, self._n_ops = graph.key, len(graph.op_nodes())
        # a graph that draws random numbers (dropout) has no kept form: the full form run again for
        # an output outside it would draw others than the forward did
        self._random = any(_draws(n) for n in graph.op_nodes())

    def programs(self) -> list:
        """The programs built of its forms' forward and backward graphs (none on eager alone)."""
        return [b.program for f in self._forms.values() for b in f.made if b.program is not None]

    def _prepare(self, examples: list[torch.Tensor]) -> None:
        """The full form traced and built; which outputs require grad, and what each reaches."""
        with torch.enable_grad():
            outs = self._graph(*examples)
            self._reach = _reach(outs, examples)
            self._grads = [isinstance(o, torch.Tensor) and o.requires_grad for o in outs]
        self._forms[None].prepare(examples)

    def saw(self, given: frozenset[int]) -> None:
        """A backward got gradients for the outputs `given`."""
        self._given = (self._given[1], given)

    def _available(self, form: _Form, inputs: list, submit: Callable | None, prepare: Callable) -> bool:
        """Is `form` ready to run? Its making started (off the call by `submit`) if not."""
        if not form.ready and not form.failed:
            if form.job is None:
                examples = [_example(t) for t in inputs]
                form.job = submit(prepare, examples) if submit is not None else _done(prepare, examples)
            if form.job.done() and form.job.exception() is not None:
                e = form.job.exception()
                form.failed = True
                events.fallback("replay", f"no backward for its graph: {type(e).__name__}: {e}", self._key, self._n_ops)
        return form.ready

    def _form(self, inputs: list, submit: Callable | None) -> _Form:
        """The form for the outputs the last two backwards got gradients for, where it is ready."""
        last, now = self._given
        kept = now if now is not None and now == last and len(now) < sum(self._grads) and not self._random else None
        form = self._forms.get(kept)
        if form is None and kept is not None and len(self._forms) <= _KEPT_FORMS:
            form = self._forms[kept] = _Form(self._graph, kept, self._delegates, self._build)
        if form is None or not self._available(form, inputs, submit, form.prepare):
            return self._forms[None]
        return form

    def __call__(self, inputs: list[torch.Tensor], submit: Callable[..., Future] | None = None) -> list | None:
        """The outputs, carrying the backward; None while it is being made off the call (`submit`
        runs a job there; None: made in the call), and for good if it could not be made (an op
        AOTAutograd cannot differentiate: the calls go on recording, as eager runs them)."""
        if not self._available(self._forms[None], inputs, submit, self._prepare):
            return None
        form = self._form(inputs, submit)
        if self._state:
            inputs = list(inputs)
            for i in self._state:
                inputs[i] = inputs[i].clone()
        return list(_AsEager.apply(self, form, *inputs))


class _AsEager(torch.autograd.Function):
    """AOTAutograd's function, with eager's gradients where no gradient reaches: its one autograd
    node joins every input to every output, so an output the loss never reads (ActMAD's logits)
    would send zeros to the weights only it depends on, where eager leaves their `.grad` None (an
    optimizer with weight decay then moves them, and a weight baked into a program is found
    written). The backward asks the inner function for the gradients of the outputs that got one,
    and gives None to every input that eager's graph does not reach from those (`_reach`); where
    the form run detached one of those outputs, the full form runs again to differentiate it."""

    @staticmethod
    def forward(ctx, whole: Differentiable, form: _Form, *inputs: torch.Tensor) -> tuple:
        ctx.set_materialize_grads(False)
        leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
        with torch.enable_grad():
            outs = form.run(*leaves)
        # saved, not kept on ctx: autograd frees the inner graph after a backward without retain_graph
        values = [*leaves, *outs]
        ctx.save_for_backward(*[v for v in values if isinstance(v, torch.Tensor)])
        ctx.values, ctx.n, ctx.whole, ctx.form = [None if isinstance(v, torch.Tensor) else v for v in values], \
            len(leaves), whole, form
        ctx.mark_non_differentiable(*[o for o, grad in zip(outs, whole._grads) if isinstance(o, torch.Tensor) and not grad])
        return tuple(o.detach() if isinstance(o, torch.Tensor) else o for o in outs)

    @staticmethod
    def backward(ctx, *grads: torch.Tensor | None) -> tuple:
        tensors = iter(ctx.saved_tensors)
        values = [next(tensors) if v is None else v for v in ctx.values]
        leaves, outs = values[:ctx.n], values[ctx.n:]
        whole = ctx.whole
        given = [k for k, g in enumerate(grads) if g is not None and whole._grads[k]]
        whole.saw(frozenset(given))
        if ctx.form.kept is not None and not ctx.form.kept.issuperset(given):
            leaves = [x.detach().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in leaves]
            with torch.enable_grad():
                outs = whole._forms[None].run(*leaves)
        reached = frozenset().union(*[whole._reach[k] for k in given])
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


def _draws(n: fx.Node) -> bool:
    """Does the op draw random numbers? Attention is tagged so for its dropout, which is 0 in eval
    and in most models (RT-DETR's): it draws with a dropout above 0."""
    if torch.Tag.nondeterministic_seeded not in getattr(n.target, "tags", ()):
        return False
    names = [a.name for a in n.target._schema.arguments]
    if "dropout_p" in names:
        k = names.index("dropout_p")
        return bool(n.args[k] if len(n.args) > k else n.kwargs.get("dropout_p", 0.0))
    return True


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

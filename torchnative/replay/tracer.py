"""The `Tracer`: it watches one recorded call (replay/session.py) and describes it as a `Trace`
(replay/trace.py), or says why the call is `Ineligible`.

An argument object (a KV cache) is guarded by identity and Python state (replay/guard.py); the
tensors it holds are read where they sit, written back by the programs at the call's end (a StaticCache's, in
place), or replaced by values the programs made (a DynamicCache's, grown by a step); a call that
changes anything else of that state is ineligible. Anything else Python did with tensor data (a random
op, an eager fallback op, `.tolist()`) makes the call ineligible; the reason is counted in
`stats()["replay_ineligible"]`. Any other tensor a graph reads (a function's lru_cache, a global
table) is read where it sits, as a weight is: replay needs two calls in a row to read the same
object (Trace.same_as; the trace holds it, so its id is not reused), so one Python makes anew each
call (`torch.from_numpy`) never replays. A 0-dim tensor torch made of a
Python number (`spatial_shapes[i, 0] = height`) is a literal: replay needs two calls in a row with
its value, as it does for a Python scalar the call returns.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch
from torch.utils import _pytree as pytree

from torchnative.replay.guard import SCALARS, Snapshot, is_plain
from torchnative.replay.hooks import HookLog
from torchnative.replay.trace import GraphCall, Ineligible, Trace
from torchnative.replay.watch import float_sets, mode_sets, module_changes

aten = torch.ops.aten
_SCALAR_READ = aten._local_scalar_dense.default


class Tracer:
    """Watches one recorded call: the programs it ran and what Python did with their values."""

    def __init__(self, hook_set: tuple = ()) -> None:
        """`hook_set`: the model's forward hooks when the call started (replay/hooks.hooks_of)."""
        self.runs: list[tuple] = []       # (program, inputs, values, roots it wrote, values[roots])
        self.recorded: list = []          # per run: its graph (recording.trie.Recorded)
        self.timed: list = []             # per run: the cost rule's key, if it ran on eager until its compile repays
        self.stand_ins: list = []         # per run: the key of the build it ran on eager for, if any
        self.costs: list[tuple] = []      # (the cost rule's key, seconds) of those runs (replay/worth.py)
        self.compiling = False            # a graph ran on eager while its program compiles in the background
        self.reads: list[tuple] = []      # (tensor read, value)
        self.checks: list[tuple] = []     # (WeightRead, weights, value, runs before it)
        self.why: str | None = None
        self.changes = module_changes()
        self.float_sets, self.mode_sets = float_sets(), mode_sets()
        self.calc = None  # replay/floats.Calc: what the call made of the module's dynamic float attributes
        self.hooks = HookLog()  # the forward hooks the call ran (replay/hooks.py)
        self.hook_set = hook_set

    def ran(self, program: Any, inputs: list, values: list, roots: list, recorded: Any = None,
            timed: tuple | None = None, seconds: float = 0.0, stand_in: tuple | None = None) -> None:
        """`roots`: real tensors the run wrote (a KV cache); the last len(roots) values.
        `recorded`: the graph (recording.trie.Recorded); `timed`: see GraphCall.timed, and the
        `seconds` the run took."""
        n = len(values) - len(roots)
        self.runs.append((program, list(inputs), list(values[:n]), list(roots)))
        self.recorded.append(recorded)
        self.timed.append(timed)
        self.stand_ins.append(stand_in)
        if timed is not None:
            self.costs.append((timed, seconds))

    def eager(self, op: Any, args: tuple, out: Any) -> None:
        """Python ran `op` outside a graph (a cut, a random op) or read a lazy tensor's data."""
        if op is _SCALAR_READ:
            t = args[0]
            self.reads.append((t._value if hasattr(t, "_slot") else t, out))
        else:
            self.refuse(f"{op if op is not None else 'data read'} ran outside a graph")

    def checked(self, read: Any, weights: list, value: Any) -> None:
        """Python read `value` of data computed from `weights` alone, without a cut
        (recording.recorder.WeightRead): a replay computes it again before its programs run."""
        self.checks.append((read, tuple(weights), value, len(self.runs)))

    def refuse(self, why: str) -> None:
        if self.why is None:
            self.why = why

    def trace(self, leaves: list, weights: Callable[[torch.Tensor], bool], out: Any, before: dict[int, Snapshot],
              after: dict[int, Snapshot], objects: bool = True) -> Trace:
        """`before`, `after`: the argument objects' snapshots at the call's start and end;
        `objects`: an object the output holds that is no argument (a DynamicCache a causal LM's
        forward makes) is rebuilt by the replay (`_made`)."""
        if self.why is not None or self.hooks.why is not None:
            raise Ineligible(self.why or self.hooks.why)
        if module_changes() != self.changes or float_sets() != self.float_sets or mode_sets() != self.mode_sets:
            raise Ineligible("the call set a module attribute or registered a parameter or buffer (a replay would skip it)")
        where: dict[int, tuple] = {}    # id(tensor) -> source
        sits: list[int] = []            # arguments whose offsets a view source counts from their storage's start
        storages: dict[int, tuple] = {}  # storage address -> source of a tensor on that storage

        def known(x: torch.Tensor, src: tuple) -> None:
            where[id(x)] = src
            if x.numel():
                storages.setdefault(x.untyped_storage().data_ptr(), src)

        for i, x in enumerate(leaves):
            if isinstance(x, torch.Tensor):
                known(x, ("arg", i))
            elif type(x) not in SCALARS:  # an object argument (a cache): its tensors, where they sit
                where[id(x)] = ("arg", i)
                for k, t in enumerate(before[i].values()):
                    where.setdefault(id(t), ("field", i, k))

        def source(x: Any) -> tuple:
            s = where.get(id(x))
            if s is not None:
                return s
            if type(x) is float and self.calc is not None:  # made of a dynamic float attribute: made again
                expr = self.calc.expression(x)
                if expr is not None:
                    return ("calc", expr)
            if isinstance(x, torch.Tensor) and x.numel() and x.untyped_storage().data_ptr() in rewritten:
                raise Ineligible("a graph reads a view of a tensor an earlier graph wrote (a replay writes it at the end)")
            if not isinstance(x, torch.Tensor):
                if type(x) in SCALARS:
                    return ("py", x)
                raise Ineligible(f"the output holds a {type(x).__name__}")
            if weights(x) or not x.numel():  # an empty tensor has no data to differ
                return ("const", x)
            base = storages.get(x.untyped_storage().data_ptr()) if x.numel() else None
            if base is not None:  # a view Python took of a graph value (logits = mm(...).view(...))
                if base[0] == "arg":
                    sits.append(base[1])
                return ("view", base, tuple(x.shape), x.stride(), x.storage_offset())
            if not x.dim() and x.device.type == "cpu":  # a Python number torch made a tensor (t[i] = n)
                return ("lit", x)
            return ("const", x)  # a tensor Python keeps outside the module (a function's lru_cache)

        reads: list[list] = [[] for _ in self.runs]
        produced = {id(v): (k, j) for k, run in enumerate(self.runs) for j, v in enumerate(run[2])}
        # a replay writes every graph's real tensors at its end, once every guard held: a later
        # graph reads the value written, not the tensor; a view of it cannot be read so
        homes: dict[int, tuple] = {}  # id(written tensor) -> where it sits
        rewritten: set[int] = set()   # their storages
        for t, value in self.reads:
            if id(t) not in produced:
                raise Ineligible("Python read a scalar of a tensor that is not a graph output")
            k, j = produced[id(t)]
            reads[k].append((j, value))
        steps = []
        for k, (program, inputs, values, roots) in enumerate(self.runs):
            if not all(isinstance(x, torch.Tensor) or source(x)[0] == "calc" for x in inputs):
                raise Ineligible("a Python float that changes between calls is an input of a graph, and not one "
                                 "computed from a module's float attribute (a replay cannot know its next value)")
            grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in inputs)
            if grad and not all(isinstance(x, torch.Tensor) for x in inputs):
                # the replay's backward (build/differentiable.py) would hold the float it was traced with
                raise Ineligible("a graph autograd records reads a Python float that changes between calls")
            sources = tuple(source(x) for x in inputs)
            writes = tuple(homes.setdefault(id(r), source(r)) for r in roots)
            # "out": a buffer an earlier graph made (a scan's `out = torch.empty(...)`, `out[t] = y` after a cut)
            if any(w[0] not in ("arg", "field", "const", "out") for w in writes):
                raise Ineligible("a graph writes into a tensor that is not an argument, reachable from one, or made by the call")
            steps.append(GraphCall(program, sources, tuple(reads[k]), writes, self.timed[k], grad, self.stand_ins[k]))
            for j, v in enumerate(values):
                known(v, ("out", k, j))
            for j, r in enumerate(roots, len(values)):
                where[id(r)] = ("out", k, j)
                rewritten.add(r.untyped_storage().data_ptr())
        checks = []
        for read, tensors, value, runs in self.checks:
            # a replay computes the read before any program: from the weights as the call found them
            if any(r is t for run in self.runs[:runs] for r in run[3] for t in tensors):
                raise Ineligible("Python read data of weights an earlier graph of the call wrote")
            checks.append((read, tensors, value))
        replaced, filled = _replaced(before, after)
        sets = tuple((at, source(t)) for at, t in replaced)
        fills = tuple((at, source(v)) for at, v in filled)
        outputs, spec = pytree.tree_flatten(out)
        if not is_plain(spec):
            raise Ineligible(f"the output holds a {spec.type.__name__}, an object Python may update")
        hooks = []
        for hook, module, args in self.hooks.calls:
            given, given_spec = pytree.tree_flatten(args)
            if not is_plain(given_spec) or not all(isinstance(x, torch.Tensor) or type(x) in SCALARS for x in given):
                raise Ineligible(f"a forward hook is given an object a replay cannot rebuild ({given_spec.type.__name__})")
            hooks.append((hook, module, tuple(source(getattr(x, "_value", x)) for x in given), given_spec))
        out_sources = tuple(_made(o, source, where) if _is_object(o) and objects else source(o) for o in outputs)
        if sits or any(r is not None and r.absolute for r in self.recorded):
            offsets = tuple((i, x.storage_offset()) for i, x in enumerate(leaves) if isinstance(x, torch.Tensor))
        else:
            offsets = ()
        return Trace(tuple(steps), out_sources, spec, module_changes(), sets, tuple(hooks), self.hook_set, offsets,
                     tuple(checks), fills=fills, floats=tuple(self.calc.checks) if self.calc is not None else (),
                     attrs=self.calc.attrs if self.calc is not None else ())


def _replaced(before: dict[int, Snapshot], after: dict[int, Snapshot]) -> tuple[list, list]:
    """What the call put into its argument objects: ((argument, k), new tensor) for each tensor an
    object holds that it replaced (a DynamicCache's keys grown by a step), and where the object's
    structure changed (a cache filled on its first call: a layer's keys None, then a tensor, and
    `is_initialized` True), ((argument, path), value) for each field set (`_filled`)."""
    replaced: list = []
    filled: list = []
    for i, old in before.items():
        new = after[i]
        if new is old:
            continue
        if new.obj is not old.obj:
            raise Ineligible("the call changed the Python state of an argument object")
        if _masked(new.state) != _masked(old.state):
            filled += [((i, path), v) for path, v in _filled(old, new)]
            continue
        for k, (a, b, place) in enumerate(zip(old.values(), new.values(), new.places)):
            if a is not b:
                if place is None:
                    raise Ineligible("the call replaced a tensor an argument object holds in a tuple")
                replaced.append(((i, k), b))
    return replaced, filled


def _filled(old: Snapshot, new: Snapshot) -> list[tuple[tuple, Any]]:
    """(path, value) for each field of the object that the call set: a scalar changed, or a
    tensor put where there was none or another; a path is the steps from the object to the field
    (`put_path`). The object's own containers and objects must stay (a replay sets fields, it
    makes no objects): a field's structure that changed otherwise makes the call ineligible."""
    olds, news = iter(old.values()), iter(new.values())
    edits: list[tuple[tuple, Any]] = []

    def skip(state: Any) -> None:  # past the tensors of a state the call replaced, in walk order
        if _is_tensor(state):
            next(olds)
        elif type(state) is tuple and state[0] != "O":
            for item in state[1:]:
                skip(item[1] if _fields(state) else item)

    def walk(a: Any, b: Any, path: tuple) -> None:
        if _is_tensor(b):
            t = next(news)
            if _is_tensor(a):
                if next(olds) is t:
                    return
            elif type(a) is tuple:
                raise Ineligible("the call replaced a container an argument object holds by a tensor")
            edits.append((path, t))
            return
        if type(b) is not tuple or b[0] == "O":
            skip(a)
            if a != b:
                if type(b) is tuple:
                    raise Ineligible("the call replaced an object an argument object holds")
                edits.append((path, b))
            return
        if type(a) is not tuple or a[0] != b[0] or _is_tensor(a):
            raise Ineligible("the call changed the Python state of an argument object: it made an object or container")
        if not _fields(b):  # a list or tuple
            if len(a) != len(b):
                raise Ineligible("the call changed the length of a list an argument object holds")
            for k, (x, y) in enumerate(zip(a[1:], b[1:])):
                walk(x, y, path + ((b[0] == "tuple", k),))
            return
        was = dict(a[1:])
        if [k for k, _ in b[1:] if k in was] != list(was):
            raise Ineligible("the call deleted a field of an object an argument object holds")
        for k, y in b[1:]:
            if k in was:
                walk(was[k], y, path + ((False, k),))
            elif _is_tensor(y) or type(y) is not tuple:
                walk(None, y, path + ((False, k),))
            else:
                raise Ineligible("the call gave an object an argument object holds a new container field")

    walk(old.state, new.state, ())
    for path, _ in edits:
        if any(in_tuple for in_tuple, _ in path):
            raise Ineligible("the call replaced a tensor an argument object holds in a tuple")
    return [(tuple(k for _, k in path), v) for path, v in edits]


def _is_object(x: Any) -> bool:
    return not isinstance(x, torch.Tensor) and type(x) not in SCALARS


def _made(x: Any, source: Callable[[Any], tuple], where: dict) -> tuple:
    """The source of an object the output holds: an argument object as such; another (the
    DynamicCache `model(input_ids)` makes) as ("new", its recipe), which a replay builds anew
    (trace._build): each object of it of its type without its __init__, with its fields (and a
    weak reference to it, by which Trace.same_as sees that the next call made another), lists,
    tuples and dicts as they were, scalars by value, tensors by their sources. Only what the
    state walk (guard.object_state) sees through: an object with slots, or deeper than the walk,
    is refused; so is one the call returns again (a module's, or a config a cache points to),
    which a replay would copy."""
    if id(x) in where:
        return where[id(x)]

    def recipe(v: Any, depth: int) -> tuple:
        tp = type(v)
        if tp in SCALARS:
            return ("py", v)
        if isinstance(v, torch.Tensor):
            return source(v)
        if depth == 0:
            raise Ineligible(f"the output holds a {type(x).__name__} nested deeper than a replay rebuilds")
        if tp is list or tp is tuple:
            return (tp.__name__, tuple(recipe(i, depth - 1) for i in v))
        if tp is dict:
            return ("dict", tuple((k, recipe(i, depth - 1)) for k, i in v.items()))
        fields = getattr(v, "__dict__", None)
        if fields is None or _slotted(tp) or isinstance(v, torch.nn.Module):
            raise Ineligible(f"the output holds a {tp.__name__}, an object a replay cannot rebuild")
        try:
            ref = weakref.ref(v)
        except TypeError:
            raise Ineligible(f"the output holds a {tp.__name__}, an object a replay cannot rebuild") from None
        return ("object", tp, ref, tuple((k, recipe(i, depth - 1)) for k, i in fields.items()))
    return ("new", recipe(x, 5))


def _slotted(tp: type) -> bool:
    """Does the class keep fields in slots (which neither the state walk nor a rebuild sees)?"""
    for c in tp.__mro__:
        names = getattr(c, "__slots__", ())
        if any(n not in ("__dict__", "__weakref__") for n in ((names,) if isinstance(names, str) else names)):
            return True
    return False


def _is_tensor(state: Any) -> bool:
    return type(state) is tuple and len(state) == 4 and state[0] == "T" and type(state[1]) is torch.Size


def _fields(state: tuple) -> bool:
    """Is this state an object's or dict's (items (name, state)), not a list's or tuple's?"""
    return state[0] not in ("list", "tuple")


def _masked(state: Any) -> Any:
    """An object's state with its tensors' metadata left out: which tensors, not their sizes."""
    if type(state) is tuple:
        if state and state[0] == "T" and len(state) == 4:
            return "T"
        return tuple(_masked(s) for s in state)
    return state

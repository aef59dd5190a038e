"""Lazy recording at the door.

The Recorder is the door's handler while capturing. Ops on lazy tensors (and factory ops, and
ops on real tensors) return pending LazyTensors that carry metadata only; real tensors become
graph inputs; in-place ops are recorded functionally and written back; ops that need data cut
the graph: the pending graph runs (through the injected `execute`), every live lazy tensor is
materialized, and the op runs eagerly.

Warm path per op: classify (dict) → encode arguments → one trie lookup → wrap the outputs.
"""
from __future__ import annotations

import functools
import weakref
from typing import Any, Callable

import torch
from torchnative.shim.door import no_dispatch_modes

from torchnative import events
from torchnative.grad import copy_back
from torchnative.recording import scalars, trie, views
from torchnative.recording.meta import Unrecordable, infer, meta_of, recorded_meta
from torchnative.recording.source import user_frame
from torchnative.recording.ops import _CLASSES, Kind, classify, explicit_offset
from torchnative.recording.trie import INPUT, REFS, ROOT, Recorded, TrieNode, Ref, Signature, build_graph, slot_of
from torchnative.shim import DoorMode, LazyTensor, run_eagerly

aten = torch.ops.aten
_make = torch.Tensor._make_wrapper_subclass
_no_data = torch._C._set_throw_on_mutable_data_ptr
_DATA = torch._C.TensorBase.data  # the getset descriptor
_wref = weakref.ref
_inference = torch.is_inference_mode_enabled
_normal = functools.partial(torch.inference_mode, False)
_TRUE, _FALSE = "\0T", "\0F"
_RECORD, _DIRECT, _DECOMPOSE, _INPLACE, _IDENTITY, _RESHAPE, _ANSWER, _RANDOM, _READ, _ASIDE = (
    Kind.RECORD, Kind.DIRECT, Kind.DECOMPOSE, Kind.INPLACE, Kind.IDENTITY, Kind.RESHAPE, Kind.ANSWER, Kind.RANDOM,
    Kind.READ, Kind.ASIDE)
_CUTS = (Kind.CUT, Kind.READ)
_NO_ANSWER = object()
_VALUE = object()  # WeightRead.plain: an argument computed by its graph
_PLAIN = (int, float, bool, type(None))

def _dtype_name(dtype: torch.dtype) -> str:
    return str(torch.empty(0, dtype=dtype, device="meta").type()).split(".")[-1].replace("Tensor", "")


Execute = Callable[[Recorded, list, int, list], list]  # (graph, inputs, ops, roots written)


def _any_pending(args: tuple, kwargs: dict) -> bool:
    for a in (*args, *kwargs.values()):
        if type(a) is LazyTensor and a._slot >= 0:
            return True
        if type(a) in (list, tuple) and _any_pending(a, {}):
            return True
    return False


def _pending(shape, stride, offset: int, dtype: torch.dtype) -> LazyTensor:
    """A wrapper with metadata only. Its storage has no memory, so C++ that reads a tensor's data
    without passing the door (`torch.utils.dlpack.to_dlpack`, or a real tensor's `numpy()`, whose
    inner `detach` the door records) raises instead of reading through a null pointer."""
    t = _make(LazyTensor, shape, stride, offset, None, dtype)
    _no_data(t)
    return t


def _set_meta(dst: LazyTensor, like: LazyTensor) -> None:
    """Give the wrapper `dst` the shape/stride of the pending `like`, keeping its Python identity."""
    with torch.no_grad():  # torch's own setter: shim/data.py's, installed while capturing, materializes
        _DATA.__set__(dst, _pending(*meta_of(like)))


def _sits_moved(x: Any) -> bool:
    """Is `x` a real tensor not at its storage's start, or a pending view of one: a graph input
    recorded as if at offset 0 (Recorder.new_input)?"""
    if type(x) is LazyTensor:
        if x._slot >= 0:
            x = x._vbase
            if x is None or type(x) is LazyTensor and x._slot >= 0:
                return False  # a pending value of its own: at its storage's start in eager too
        if type(x) is LazyTensor:
            x = x._value
    return isinstance(x, torch.Tensor) and x.storage_offset() != 0


class WeightRead:
    """A data read of values computed from weights alone, as recorded on one path: called with
    those weights' tensors (in their graph inputs' order), the Python value it reads."""

    __slots__ = ("op", "gm", "at", "n_inputs", "plain")

    def __init__(self, op, gm: torch.fx.GraphModule, at: tuple[int, ...], n_inputs: int, plain: tuple) -> None:
        self.op, self.gm, self.n_inputs, self.plain = op, gm, n_inputs, plain
        self.at = at  # the graph inputs (weights) the values are computed from

    def __call__(self, weights: list) -> Any:
        inputs: list = [None] * self.n_inputs
        for i, w in zip(self.at, weights):
            inputs[i] = w
        with no_dispatch_modes(), torch.no_grad():
            values = iter(self.gm(*inputs))
            return self.op(*[next(values) if a is _VALUE else a for a in self.plain])


class Recorder:
    def __init__(self, execute: Execute, mode: DoorMode, weights: frozenset[int] = frozenset(),
                 sites: scalars.FloatSites | None = scalars.PROCESS):
        self.execute = execute
        self.mode = mode
        self.weights = weights  # ids of tensors that are weights though not nn.Parameters (buffers)
        # where a float seen to change becomes a graph input (recording/scalars.py); None: never, for a
        # bundle, which has no Python to pass it, and whose calls (an encoder, then a decoder of the
        # same layer code) would otherwise look like one site whose floats changed
        self.sites = sites
        self.observe: Callable[[Any, tuple, Any], None] | None = None  # told of every op run eagerly
        self.check: Callable[[WeightRead, list, Any], None] | None = None  # told of every weight read (read)
        self._reset()

    def _reset(self) -> None:
        self.node: TrieNode = ROOT
        self.inputs: list[torch.Tensor] = []
        self.inslot: dict[int, int] = {}          # id(real tensor) -> input slot
        self.live: list = []                      # weakrefs to pending LazyTensors
        self.epoch = 0                            # bumped by every write
        self.rgen: dict[int, int] = {}            # id(real root) -> writes so far
        self.rcur: dict[int, Any] = {}            # id(real root) -> its current (lazy) value
        self.roots: dict[int, torch.Tensor] = {}  # id(real root) -> the root, for write-back
        self.issues: dict[tuple, int] = {}        # scalar site -> its issues so far (scalar_site)

    # -- the handler ---------------------------------------------------------------------------
    def __call__(self, op, args: tuple, kwargs: dict) -> Any:
        c = _CLASSES.get(id(op)) or classify(op)
        k = c.kind
        if k is _RECORD:
            if c.offset_at is not None and explicit_offset(c, args, kwargs) and _sits_moved(args[0]):
                # the graph has the argument at its storage's start: an offset Python counted
                # from the real start (LazyTensor.storage_offset) means what it means in eager only
                return self.cut(op, args, kwargs, f"{op} with a storage offset, of an argument that does not sit at its storage's start")
            return self.record(op, c.is_view, args, kwargs)
        if k is _DIRECT:
            return c.decomposition(self.call, *args, **kwargs)
        if k is _DECOMPOSE:
            self.mode.push()
            try:
                return c.decomposition(*args, **kwargs)
            finally:
                DoorMode.pop()
        if k is _INPLACE:
            return self.inplace(op, c.functional, args, kwargs)
        if k is _IDENTITY:
            return args[0]
        if k is _RESHAPE:
            return self.reshape_inplace(op, c.functional, args, kwargs)
        if k is _ANSWER:
            return c.decomposition(*args, **kwargs)
        if k is _RANDOM and not self.roots and not _any_pending(args, kwargs):
            return self.eagerly(op, args, kwargs)
        if k is _READ:
            return self.read(op, args, kwargs, c.reason)
        if k is _ASIDE:  # not the call's work: a replay, which skips it, computes the same
            return run_eagerly(op, args, kwargs)
        return self.cut(op, args, kwargs, c.reason)

    def eagerly(self, op, args: tuple, kwargs: dict) -> Any:
        out = run_eagerly(op, args, kwargs)
        if self.observe is not None:
            self.observe(op, args, out)
        return out

    def call(self, op, args: tuple, kwargs: dict | None = None) -> Any:
        return self(op, args, kwargs or {})

    # -- encoding: tensors become slot references, scalars keep their exact type ------------------
    def enc(self, a: Any) -> Any:
        tp = type(a)
        if tp is LazyTensor:
            s = a._slot
            if s >= 0:
                if a._vbase is not None and a._epoch != self.epoch:
                    return self.fresh_view(a)
                return REFS[s]
            return self.input_ref(a._value)
        if tp is int or a is None or tp is str:
            return a
        if tp is list or tp is tuple:
            # the schema fixes a list's element type, so an int list needs no per-element tags
            if not a or type(a[0]) is int:
                return tuple(a)
            return tuple([self.enc(x) for x in a])
        if tp is float:
            return "\0f" + a.hex()
        if tp is bool:
            return _TRUE if a else _FALSE
        if isinstance(a, torch.Tensor):
            return self.input_ref(a)
        if tp is complex:
            return "\0c" + repr(a)
        return a

    def input_ref(self, x: torch.Tensor) -> Ref:
        if self.rgen:
            root = x._base if x._base is not None else x
            if id(root) in self.rgen:
                return self.read_written(x, root)
        s = self.inslot.get(id(x))
        if s is None:
            s = self.new_input(x)
        return REFS[s]

    def new_input(self, x: torch.Tensor) -> int:
        """An input slot for the real tensor `x`, keyed by what it is (shape, strides, dtype, role)
        and not where it sits in its storage: a slice of a longer sequence at each call's offset is
        one graph (the graph sees it at offset 0; ops that take an offset are cut, __call__)."""
        role = "param" if isinstance(x, torch.nn.Parameter) or id(x) in self.weights else "input"
        try:
            key = (INPUT, tuple(x.shape), x.stride(), x.dtype, x.device, role)
        except RuntimeError as e:  # sparse and other layouts without strides
            raise Unrecordable(f"input with layout {x.layout}: {e}") from e
        node = self.node.child(key)
        if node is None:
            if x.device.type != "cpu" or x.layout != torch.strided:
                raise Unrecordable(f"input on {x.device} with layout {x.layout}")
            node = self.node.add(key, TrieNode(self.node, INPUT, (), (), (recorded_meta(x),), None, role=role))
        self.node = node
        s = node.out_slots[0]
        self.inslot[id(x)] = s
        self.inputs.append(x)
        return s

    # -- recording ------------------------------------------------------------------------------
    def record(self, op, is_view: bool, args: tuple, kwargs: dict) -> Any:
        enc, epoch, eargs = self.enc, self.epoch, []
        try:
            for a in args:  # enc() inlined for the common case: a current pending tensor
                if type(a) is LazyTensor and a._slot >= 0 and (a._vbase is None or a._epoch == epoch):
                    eargs.append(REFS[a._slot])
                else:
                    eargs.append(enc(a))
            eargs = tuple(eargs)
            ekw = tuple([(k, enc(v)) for k, v in kwargs.items()]) if kwargs else ()
            key = (id(op), eargs, ekw)
            node = self.node.child(key)
            if node is None:
                node = self.scalar_site(op, is_view, args, kwargs, eargs, ekw)
        except Unrecordable as e:
            return self.cut(op, args, kwargs, str(e))
        self.node = node
        live = self.live
        if not node.sequence:
            shape, stride, offset, dtype = node.out_metas[0]
            if is_view and _inference() and not args[0].is_inference():
                # eager's view of a normal tensor in inference mode is a normal tensor, sharing its
                # base's version counter, which torch sets on what the door returns: an inference
                # tensor there fails ("Cannot set version_counter for inference tensor")
                with _normal():
                    t = _pending(shape, stride, offset, dtype)
            else:
                t = _pending(shape, stride, offset, dtype)
            t._slot = node.out_slots[0]
            if is_view:
                self.mark_view(t, op, args, kwargs)
            live.append(_wref(t))
            return t
        outs = []
        for slot, m in zip(node.out_slots, node.out_metas):
            if m is None:
                outs.append(None)
                continue
            t = _pending(m[0], m[1], m[2], m[3])
            t._slot = slot
            live.append(_wref(t))
            outs.append(t)
        return node.sequence(outs)

    def scalar_site(self, op, is_view: bool, args: tuple, kwargs: dict, eargs: tuple, ekw: tuple) -> TrieNode:
        """The node for an op not recorded here with these arguments: its floats that were seen to
        change (recording/scalars.py) as scalar inputs of the graph, the others as constants."""
        dynamic = self.sites.dynamic_floats(op, args, kwargs, eargs, ekw, self.issues) if self.sites is not None else ()
        if dynamic:
            eargs = tuple(REFS[self.scalar_input(op, i, args[i])] if i in dynamic else a for i, a in enumerate(eargs))
            ekw = tuple((k, REFS[self.scalar_input(op, k, kwargs[k])]) if k in dynamic else (k, a) for k, a in ekw)
        key = (id(op), eargs, ekw)
        node = self.node.child(key)
        return node if node is not None else self.new_node(op, is_view, args, kwargs, key)

    def scalar_input(self, op, position: int | str, value: float) -> int:
        """A float argument of `op` (by position, or keyword) as an input of the graph (role
        `scalar`): its slot."""
        key = (INPUT, "scalar", id(op), position)
        node = self.node.child(key)
        if node is None:
            node = self.node.add(key, TrieNode(self.node, INPUT, (), (), (None,), None, role="scalar"))
        self.node = node
        self.inputs.append(value)
        return node.out_slots[0]

    def new_node(self, op, is_view: bool, args: tuple, kwargs: dict, key: tuple) -> TrieNode:
        metas, sequence = infer(op, args, kwargs)
        c = classify(op)
        absolute = c.offset_at is not None and explicit_offset(c, args, kwargs)
        node = TrieNode(self.node, op, key[1], key[2], metas, sequence, is_view=is_view, stack=user_frame(3),
                        absolute=absolute)
        return self.node.add(key, node)

    def mark_view(self, t: LazyTensor, op, args: tuple, kwargs: dict) -> None:
        src = args[0]
        step = (op, args[1:], kwargs)
        if type(src) is LazyTensor and src._slot >= 0:
            base = src._vbase
            if base is None:
                t._vbase, t._vchain, t._bgen = src, (step,), src._gen
            else:
                t._vbase, t._vchain, t._bgen = base, src._vchain + (step,), src._bgen
        else:
            base = src._value if type(src) is LazyTensor else src
            t._vbase, t._vchain, t._bgen = base, (step,), self.gen_of(base)
        t._epoch = self.epoch

    # -- views and writes -----------------------------------------------------------------------
    def gen_of(self, base: Any) -> int:
        if type(base) is LazyTensor:
            return base._gen
        if not self.rgen:
            return 0
        root = base._base if base._base is not None else base
        return self.rgen.get(id(root), 0)

    def fresh_view(self, v: LazyTensor) -> Ref:
        """The current value of a pending view whose base may have been written since."""
        g = self.gen_of(v._vbase)
        if g != v._bgen:
            v._slot = views.apply(self.call, v._vbase, v._vchain)._slot
            v._bgen = g
        v._epoch = self.epoch
        return REFS[v._slot]

    def read_written(self, x: torch.Tensor, root: torch.Tensor) -> Ref:
        cur = self.rcur[id(root)]
        if x is root:
            return self.enc(cur)
        if not (root.is_contiguous() and root.storage_offset() == 0):
            raise Unrecordable("read of a view of a non-contiguous tensor written in this graph")
        dense = self.call(aten.clone.default, (cur,), {"memory_format": torch.contiguous_format})
        return self.enc(self.call(aten.as_strided.default, (dense, list(x.shape), list(x.stride()), x.storage_offset())))

    def inplace(self, op, functional, args: tuple, kwargs: dict) -> Any:
        if classify(functional).kind in _CUTS:
            return self.cut(op, args, kwargs, classify(functional).reason)
        dst = args[0]
        new = self.call(functional, args, kwargs)
        if new.dtype != dst.dtype:
            if not torch.can_cast(new.dtype, dst.dtype):
                raise RuntimeError(f"result type {_dtype_name(new.dtype)} can't be cast to the desired output type {_dtype_name(dst.dtype)}")
            new = self.call(aten._to_copy.default, (new,), {"dtype": dst.dtype})
        if tuple(new.shape) != tuple(dst.shape):
            raise RuntimeError(f"{op}: output with shape {list(dst.shape)} doesn't match the broadcast shape {list(new.shape)}")
        try:
            self.assign(dst, new)
        except Unrecordable as e:
            return self.cut(op, args, kwargs, str(e))
        return dst

    def reshape_inplace(self, op, view_op, args: tuple, kwargs: dict) -> Any:
        """`x.squeeze_()` and friends: x becomes the view, in place (same Python object)."""
        dst = args[0]
        if type(dst) is not LazyTensor or dst._slot < 0:
            return self.cut(op, args, kwargs, f"in-place metadata change of a real tensor: {op}")
        new = self.call(view_op, args, kwargs)
        _set_meta(dst, new)
        dst._slot = new._slot
        if dst._vbase is not None:  # still a view of the same root, one step further
            dst._vchain, dst._bgen, dst._epoch = new._vchain, new._bgen, new._epoch
        return dst

    def assign(self, dst: Any, new: Any) -> None:
        """Record that `dst` now holds `new` (same shape and dtype)."""
        self.epoch += 1
        if type(dst) is LazyTensor and dst._slot >= 0:
            base = dst._vbase
            if base is not None:
                self.assign(base, views.scatter(self.call, base, dst._vchain, new))
                dst._bgen = self.gen_of(base)
            else:
                dst._gen += 1
            dst._slot = slot_of(self.enc(new))
            dst._epoch = self.epoch
            return
        x = dst._value if type(dst) is LazyTensor else dst
        root = x._base if x._base is not None else x
        if root is not x:
            if not (root.is_contiguous() and root.storage_offset() == 0):
                raise Unrecordable("in-place write into a view of a non-contiguous real tensor")
            cur = self.rcur.get(id(root), root)
            dense = self.call(aten.clone.default, (cur,), {"memory_format": torch.contiguous_format})
            new = self.call(aten.as_strided_scatter.default,
                            (dense, new, list(x.shape), list(x.stride()), x.storage_offset()))
        self.enc(root)  # the root is a graph input before its first write
        self.rcur[id(root)] = new
        self.rgen[id(root)] = self.rgen.get(id(root), 0) + 1
        self.roots[id(root)] = root

    # -- reads and cuts -------------------------------------------------------------------------
    def read(self, op, args: tuple, kwargs: dict, reason: str) -> Any:
        """A Python value from pending data. Data computed from no graph input (positions from an
        arange, a mask from shapes) is a function of the recorded path alone, so its value is the
        same on every call that records this path: it is computed apart, once per path, and the
        graph goes on. Data computed from weights alone (`not torch.isnan(self.bias).any()` in
        every step of a scan) is computed apart from their current values on every call, and the
        graph goes on too; whoever watches (`check`: a replay's tracer) is told, to compute it
        again. Anything else cuts the graph here."""
        epoch = self.epoch

        def current(a: Any) -> bool:  # a pending value, not a stale view: no op to record for it
            return type(a) is LazyTensor and a._slot >= 0 and (a._vbase is None or a._epoch == epoch)

        if kwargs or not all(type(a) in _PLAIN or current(a) for a in args):
            return self.cut(op, args, kwargs, reason)
        key = (id(op), tuple([self.enc(a) for a in args]))
        answers = self.node.answers
        if answers is None:
            answers = self.node.answers = {}
        answer = answers.get(key)
        if answer is None:
            answer = answers[key] = self.answer(op, args)
        if answer is _NO_ANSWER:
            return self.cut(op, args, kwargs, reason)
        if type(answer) is WeightRead:
            weights = [self.inputs[i] for i in answer.at]
            value = answer(weights)
            if self.check is not None:
                self.check(answer, weights, value)
            return value
        return answer

    def answer(self, op, args: tuple) -> Any:
        """`op` run on the values of its pending arguments when no graph input reaches them; a
        `WeightRead` when weights alone reach them; else _NO_ANSWER."""
        tensors = [a for a in args if type(a) is LazyTensor]
        graph = build_graph(self.node, Signature(tuple(t._slot for t in tensors), ()), pruned=True)
        used = tuple(i for i, p in enumerate(graph.gm.graph.find_nodes(op="placeholder")) if p.users)
        read = WeightRead(op, graph.gm, used, len(graph.input_roles), tuple(_VALUE if type(a) is LazyTensor else a for a in args))
        if not used:
            return read([])  # a function of the path alone
        return read if all(graph.input_roles[i] == "param" for i in used) else _NO_ANSWER

    def cut(self, op, args: tuple, kwargs: dict, reason: str) -> Any:
        self.flush(reason, op)
        out = self.eagerly(op, args, kwargs)
        dst = args[0] if args else None
        if type(dst) is LazyTensor and op._schema.is_mutable and dst._value.shape != dst.shape:
            _set_meta(dst, dst._value)  # resize_/set_ changed the real value's shape
        return out

    def written(self, t: torch.Tensor, reason: str) -> None:
        """Python reads a real tensor's memory outside the dispatcher (`t.data`): writes the pending
        graph makes to it run first."""
        if id(t) in self.roots:
            self.flush(reason)

    def read_real(self, t: torch.Tensor, reason: str) -> None:
        """Python reads a real tensor's memory outside the dispatcher (`t.numpy()`): writes the
        pending graph makes to it run first, and whoever watches is told of the read."""
        self.written(t._base if t._base is not None else t, reason)
        if self.observe is not None:
            self.observe(None, (t,), None)

    def sync(self, t: LazyTensor, reason: str) -> None:
        """Called by a lazy tensor whose data Python needs (tolist, numpy, data_ptr, repr)."""
        if t._slot >= 0 or self.roots:
            self.flush(reason, None)
        if self.observe is not None:
            self.observe(None, (t,), None)

    def flush(self, reason: str | None = None, op: Any = None) -> None:
        """Run the pending graph and materialize every live lazy tensor it produced."""
        if reason is not None:
            events.STATS.syncs[reason.split(":")[0]] += 1
            filename, line = user_frame(3)
            events.emit(events.GraphBreak(reason, str(op) if op is not None else reason, filename, line))
        if self.node is ROOT:
            return
        with no_dispatch_modes():
            self._flush()

    def _flush(self) -> None:
        state = tuple((self.inslot[i], slot_of(self.enc(self.rcur[i]))) for i in self.roots)
        # a root's new value that only this dict holds (a counter's `add_`) is not an output: it
        # is the state update alone, which a delegate may then write where it reuses a buffer
        self.rcur = {}
        bases, pviews = [], []
        for w in self.live:
            t = w()
            if t is not None and t._slot >= 0:
                (pviews if t._vbase is not None else bases).append(t)
        outputs = tuple(dict.fromkeys(t._slot for t in bases))
        node, inputs, roots = self.node, self.inputs, list(self.roots.values())
        n_ops = self.node.n_ops
        events.STATS.ops_recorded += n_ops
        self._reset()
        trie.bound()
        tracked = [r for r in roots if not r.is_inference()]  # an inference tensor has no version
        versions = [r._version for r in tracked]  # before the run: a program may write state in place
        try:
            values = self.execute(Recorded(node, Signature(outputs, state)), inputs, n_ops, roots)
        except BaseException:
            for t in bases + pviews:  # their graph failed: they never get a value
                t._slot = -1
            raise
        by_slot = dict(zip(outputs, values))
        for t in bases:
            t._value = by_slot[t._slot]
            t._slot = -1
        if roots:
            # each in-place op already bumped its tensor's version above the door, as in eager;
            # the write-back is not one of the user's ops (a kernel's own writes, like BatchNorm's
            # running stats, bump nothing in eager), and autograd checks saved tensors' versions
            copy_back(roots, values[len(outputs):])
            torch._C._autograd._unsafe_set_version_counter(tracked, versions)
        for t in pviews:
            base = t._vbase
            v = views.materialize(base._value if type(base) is LazyTensor else base, t._vchain)
            t._value, t._slot, t._vbase, t._vchain = v, -1, None, None

"""Replay of a forward proven stable (replay/replayer.py): outputs stay eager's when the guards
hold, and a call is recorded again whenever Python might have done something different."""
import copy
import functools

import numpy as np
import pytest
import torch

import torchnative
from tests.conftest import assert_same
from torchnative import models

DELEGATES = [["eager"], ["ort"]]


def _calls(model, inputs: list[dict]) -> list:
    with torch.no_grad():
        return [model(**kw) for kw in inputs]


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
@pytest.mark.parametrize("name", ["gpt2", "bert"])
def test_stable_forward_replays_with_eager_outputs(name, delegates):
    model = models.build(name)
    inputs = [models.example_inputs(name, model, batch=2, seq=8) for _ in range(4)]
    if name == "gpt2":  # a KV cache object made inside forward and returned is never replayed
        inputs = [dict(kw, use_cache=False) for kw in inputs]
    for kw in inputs[2:]:
        kw["input_ids"] = torch.randint_like(kw["input_ids"], 100)  # new values, same metadata
    ref = _calls(model, inputs)
    torchnative.accelerate(model, delegates=delegates, compile_after=1)
    torchnative.reset_stats()
    out = _calls(model, inputs)
    key = "logits" if "logits" in ref[0] else "last_hidden_state"
    for o, r in zip(out, ref):
        assert type(o) is type(r) and o.keys() == r.keys() and vars(o).keys() == vars(r).keys()
        assert all((v is None) == (vars(r)[k] is None) for k, v in vars(o).items())
        assert o.to_tuple()[0] is o[key] is getattr(o, key)
        assert_same(o[key], r[key], rtol=1e-4, atol=1e-5)
    s = torchnative.stats()
    assert s["replays"] == 2, s
    assert s["ops_recorded"] > 0 and not s["replay_ineligible"]


class Branchy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = self.lin(x)
        if y.sum() > 0:  # data-dependent Python: a replay must check the scalar it read
            return y * 2
        return y - 1


def test_scalar_that_differs_records_the_call_again():
    model = Branchy()
    pos, neg = torch.full((2, 4), 10.0), torch.full((2, 4), -10.0)
    with torch.no_grad():
        model.lin.weight.copy_(torch.eye(4))
        model.lin.bias.zero_()
        ref = [model(x) for x in (pos, pos, pos, neg, neg, neg, neg)]
        torchnative.accelerate(model, delegates=["eager"])  # one program per graph: counts are exact
        torchnative.reset_stats()
        out = [model(x) for x in (pos, pos, pos, neg, neg, neg, neg)]
    for o, r in zip(out, ref):
        assert_same(o, r)
    s = torchnative.stats()
    # pos, pos: recorded; pos: replayed; neg: misses, recorded; neg: recorded; neg, neg: replayed
    assert s["replay_misses"] == 1 and s["replays"] == 3, s


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_weights_changed_in_place_or_reassigned_are_seen(delegates):
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))
    x = torch.randn(4, 8)
    torchnative.accelerate(model, delegates=delegates)
    with torch.no_grad():
        for _ in range(3):
            model(x)
        model[0].weight.add_(0.5)           # an optimizer step
        after_step = torchnative.deaccelerate(model)(x)
        torchnative.accelerate(model, delegates=delegates)
        for _ in range(3):
            model(x)
        assert_same(model(x), after_step)
        model[2].weight = torch.nn.Parameter(torch.randn(3, 8))  # a new tensor altogether
        assert_same(model(x), torchnative.deaccelerate(model)(x))


def test_random_ops_are_never_replayed():
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Dropout(0.5)).train()
    x = torch.randn(4, 8)
    with torch.no_grad():
        ref = []
        for i in range(4):
            torch.manual_seed(i)
            ref.append(model(x))
        torchnative.accelerate(model)
        torchnative.reset_stats()
        for i in range(4):
            torch.manual_seed(i)
            assert_same(model(x), ref[i])
    s = torchnative.stats()
    assert s["replays"] == 0 and s["replay_ineligible"], s


def test_python_side_effects_run_unless_replay_is_on():
    class Counting(torch.nn.Module):
        def __init__(self, log: list):
            super().__init__()
            self.calls, self.log = 0, log

        def forward(self, x):
            self.calls += 1  # a module attribute: such a call is never replayed
            self.log.append(1)
            return x + 1

    class Logging(Counting):
        def forward(self, x):
            self.log.append(1)  # Python state no guard sees: skipped on a replay
            return x + 1

    x = torch.ones(3)
    for cls, replay, calls, logged in ((Counting, False, 4, 4), (Counting, True, 4, 4), (Logging, True, 0, 2)):
        log: list = []
        model = torchnative.accelerate(cls(log), replay=replay)
        for _ in range(4):
            assert_same(model(x), x + 1)
        assert (model.calls, len(log)) == (calls, logged), cls


def test_module_attributes_set_between_calls_are_seen_by_replay():
    """`bn.momentum = m` after the forward replays: its running stats move by the new momentum
    (the replayed program had the old one baked in), as do `eval()` of a submodule's outputs."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
    ref = copy.deepcopy(net)
    torchnative.accelerate(net, delegates=["eager"])
    torchnative.reset_stats()
    x = torch.randn(2, 3, 8, 8)
    with torch.no_grad():
        for i in range(8):
            if i == 4:
                net[1].momentum = ref[1].momentum = 0.5
            if i == 6:
                net[1].eval(), ref[1].eval()
            assert_same(net(x), ref(x))
            assert_same(net[1].running_mean, ref[1].running_mean)
            assert_same(net[1].running_var, ref[1].running_var)
    assert torchnative.stats()["replays"] >= 1


def test_explain_on_an_accelerated_model_records():
    model = models.build("bert")
    kw = models.example_inputs("bert", model, seq=8)
    torchnative.accelerate(model)
    with torch.no_grad():
        for _ in range(3):
            model(**kw)
        e = torchnative.explain(model, **kw)
    assert e.graphs and e.ops_recorded > 0


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_static_cache_decode_steps_replay_with_eager_tokens(name):
    """A StaticCache argument is guarded by identity and Python state; its tensors are written
    back by the replay as by the recording."""
    model = models.build(name)
    ids = models.example_inputs(name, model, seq=8)["input_ids"]
    kwargs = dict(max_new_tokens=12, do_sample=False, pad_token_id=0, cache_implementation="static")
    ref = model.generate(ids, **kwargs)
    torchnative.accelerate(model, delegates=["eager"])
    torchnative.reset_stats()
    for _ in range(2):  # the second generate replays from its first decode step on
        assert torch.equal(model.generate(ids, **kwargs), ref)
    s = torchnative.stats()
    assert s["replays"] >= 12, s


def test_argument_object_whose_python_state_changes_is_not_replayed():
    class Counter:
        def __init__(self):
            self.n = 0

    class Model(torch.nn.Module):
        def forward(self, x, counter):
            counter.n += 1  # Python state a replay would skip
            return x * 2

    model = torchnative.accelerate(Model())
    counter, x = Counter(), torch.ones(3)
    torchnative.reset_stats()
    for _ in range(4):
        assert_same(model(x, counter), x * 2)
    assert counter.n == 4
    assert torchnative.stats()["replays"] == 0  # each call finds another count: no trace is valid for it


class _LazyCache:
    """Filled by its first call, as transformers' DynamicCache is: its fields None until then."""

    def __init__(self):
        self.layers = [_Layer(), _Layer()]


class _Layer:
    def __init__(self):
        self.keys, self.ready = None, False


class _FillsCache(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)

    def forward(self, x, cache):
        for i, layer in enumerate(cache.layers):
            if not layer.ready:
                layer.device = x.device  # a field the call adds
                layer.keys = torch.tensor([], dtype=x.dtype)
                layer.ready = True
            layer.keys = torch.cat([layer.keys, self.proj(x) * (i + 1)])
        return cache.layers[-1].keys.sum(0)


@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_a_cache_the_call_fills_replays_with_its_fields_set(delegate):
    """A new cache object each call, filled by the call (a prefill's DynamicCache): once two calls
    made the same trace, a replay sets every field the call set, as eager does."""
    torch.manual_seed(0)
    eager = _FillsCache()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate])
    torchnative.reset_stats()
    for i in range(5):
        x = torch.randn(3, 4)
        got, want = _LazyCache(), _LazyCache()
        assert_same(model(x, got), eager(x, want), atol=1e-5)
        for g, w in zip(got.layers, want.layers):
            assert g.ready is True and g.device == w.device
            assert_same(g.keys, w.keys, atol=1e-5)
    assert torchnative.stats()["replays"] >= 2


def test_a_cache_the_call_fills_replays_at_new_sizes():
    """The prefill at a new prompt length each call: a replay at a size no call recorded fills the
    cache with tensors of that size."""
    torch.manual_seed(0)
    eager = _FillsCache()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=["eager"])
    torchnative.reset_stats()
    for n in [3, 17, 5, 9, 6, 12, 7, 8, 10, 11]:  # recorded to 12 (a template from the third), then replayed
        x = torch.randn(n, 4)
        got, want = _LazyCache(), _LazyCache()
        with torch.no_grad():  # a call autograd records replays at the sizes it was recorded at only
            assert_same(model(x, got), eager(x, want), atol=1e-5)
        for g, w in zip(got.layers, want.layers):
            assert g.keys.shape == w.keys.shape == (n, 4)
            assert_same(g.keys, w.keys, atol=1e-5)
    assert torchnative.stats()["new_size_replays"] >= 3


def test_a_call_that_makes_objects_in_its_argument_is_not_replayed():
    """A replay sets fields; it makes no objects: a call that appends a layer to its cache records."""
    class Grows:
        def __init__(self):
            self.layers = []

    class Model(torch.nn.Module):
        def forward(self, x, cache):
            cache.layers.append(x * 2)
            return x + 1

    model = torchnative.accelerate(Model(), delegates=["eager"])
    torchnative.reset_stats()
    for _ in range(4):
        cache = Grows()
        assert_same(model(torch.ones(3), cache), torch.ones(3) + 1)
        assert len(cache.layers) == 1 and torch.equal(cache.layers[0], torch.ones(3) * 2)
    assert torchnative.stats()["replays"] == 0
    assert any("length of a list" in why for why in torchnative.stats()["replay_ineligible"])


def test_traces_of_argument_objects_no_longer_passed_are_let_go():
    """A model given a new cache object on every call keeps a bounded number of traces: the old
    objects (and the tensors their traces hold) can be freed."""
    import gc
    import weakref

    class Cache:
        def __init__(self):
            self.keys = torch.zeros(4, 8)

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(8, 8)

        def forward(self, x, cache):
            return self.proj(x) + cache.keys.sum(0)

    model = torchnative.accelerate(Model(), delegates=["eager"])
    x, first = torch.ones(8), None
    with torch.no_grad():
        for _ in range(40):
            cache = Cache()
            first = first or weakref.ref(cache.keys)
            for _ in range(3):  # learned, then replayed
                assert_same(model(x, cache), type(model).forward(model, x, cache))
            del cache
    gc.collect()
    assert first() is None
    assert torchnative.stats()["replays"] > 0


def test_call_flattening_is_pytrees():
    """The shortcut for argument lists without containers gives pytree's leaves and structure;
    containers (and registered types) still go through pytree."""
    from torch.utils import _pytree as pytree
    from transformers.modeling_outputs import BaseModelOutput

    from torchnative.replay.guard import flatten_call
    t, cache = torch.ones(2), object()
    calls = [((t,), {}), ((t, None, 3), {"a": t, "b": cache}), ((), {"b": cache, "a": t}),
             (([t, t],), {}), ((t,), {"x": {"y": t}}), ((BaseModelOutput(last_hidden_state=t),), {})]
    for args, kwargs in calls * 2:  # the second time from the shortcut's cache
        leaves, spec = flatten_call(args, kwargs)
        want_leaves, want_spec = pytree.tree_flatten((args, kwargs))
        assert spec == want_spec and len(leaves) == len(want_leaves)
        assert all(a is b for a, b in zip(leaves, want_leaves))


def test_argument_object_state_is_reused_only_while_unchanged():
    """The guard reuses an argument object's state while its snapshot holds; every change the
    full walk sees (a field, a list, a tensor reshaped in place) gives a new key, equal to the one
    a fresh walk gives. A tensor replaced by one of the same metadata keeps the key (a trace reads
    the tensors where they sit) and the snapshot holds the new one."""
    from torchnative.replay.guard import flatten_call, guard_key

    class Layer:
        def __init__(self):
            self.keys, self.length, self.ready = torch.zeros(2, 3), 4, False

    class Cache:
        def __init__(self):
            self.layers, self.options = [Layer(), Layer()], {"mode": "static"}

    def new_like(c):
        c.layers[1].keys = torch.zeros(2, 3)

    changes = {"int": lambda c: setattr(c.layers[0], "length", 5), "flag": lambda c: setattr(c.layers[1], "ready", True),
               "tensor replaced": new_like, "resized in place": lambda c: c.layers[0].keys.resize_(3, 2),
               "transposed in place": lambda c: c.layers[0].keys.t_(), "list grown": lambda c: c.layers.append(Layer()),
               "dict key": lambda c: c.options.update(extra=1), "field added": lambda c: setattr(c, "offloading", False)}
    model, x = torch.nn.Linear(2, 2), torch.ones(2)
    for what, change in changes.items():
        cache, snapshots = Cache(), {}
        leaves, spec = flatten_call((x,), {"cache": cache})
        before = guard_key(model, leaves, spec, snapshots)
        again = guard_key(model, leaves, spec, snapshots)
        assert again == before and again[1][1] is before[1][1], what  # the same state object, reused
        change(cache)
        after = guard_key(model, leaves, spec, snapshots)
        assert after == guard_key(model, leaves, spec, {}), what
        if what == "tensor replaced":
            assert after == before and snapshots[1].tensors[1] is cache.layers[1].keys
        else:
            assert after != before, what


def test_outputs_are_rebuilt_as_unflattening_builds_them():
    """A flat ModelOutput is rebuilt by setting its items and attributes; one whose __post_init__
    derives an attribute is unflattened by pytree, as any other structure."""
    from dataclasses import dataclass

    from torch.utils import _pytree as pytree
    from transformers.modeling_outputs import CausalLMOutputWithPast
    from transformers.utils import ModelOutput

    from torchnative.replay.trace import _builder

    @dataclass
    class Derived(ModelOutput):
        logits: torch.Tensor | None = None
        extra: torch.Tensor | None = None

        def __post_init__(self):
            super().__post_init__()
            self.total = self.logits.sum()

    for example in (CausalLMOutputWithPast(logits=torch.ones(2), past_key_values=object()), Derived(logits=torch.ones(2)),
                    (torch.ones(1), {"a": torch.ones(2)})):
        leaves, spec = pytree.tree_flatten(example)
        build = _builder(spec, leaves, pytree.tree_unflatten(leaves, spec))
        new = [torch.randn(2) if isinstance(x, torch.Tensor) else x for x in leaves]
        got, want = build(new), pytree.tree_unflatten(new, spec)
        assert type(got) is type(want)
        if isinstance(want, ModelOutput):
            assert list(got.keys()) == list(want.keys()) and all(a is b for a, b in zip(got.values(), want.values()))
            assert vars(got).keys() == vars(want).keys()
            assert got.logits is got[0] is new[0]
        if isinstance(want, Derived):
            assert torch.equal(got.total, new[0].sum())


def test_eval_at_the_top_of_every_forward_still_replays():
    """TTA methods call `self.model.eval()` at the top of each forward: setting an attribute to the
    object it holds changes nothing, so it does not count as a change a replay must see; a real
    change (`train()` on an eval model) still does."""
    torch.manual_seed(0)

    class Method(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))

        def forward(self, x):
            self.model.eval()
            return self.model(x)

    method = Method()
    ref = copy.deepcopy(method)
    torchnative.accelerate(method, delegates=["eager"])
    torchnative.reset_stats()
    x = torch.randn(4, 8)
    with torch.no_grad():
        for _ in range(5):
            assert_same(method(x), ref(x))
    assert torchnative.stats()["replays"] >= 2
    # the first call's eval() did change the mode (a new module is in train mode): that call alone
    assert sum(torchnative.stats()["replay_ineligible"].values()) == 1


def test_module_setattr_is_wrapped_only_while_a_model_is_watched():
    """Importing torchnative patches nothing; accelerate wraps Module.__setattr__ while the model
    lives, and the last watched module's end gives it back."""
    import gc
    import subprocess
    import sys

    code = ("import torchnative, torch, gc\n"
            "plain = torch.nn.Module.__setattr__\n"
            "assert getattr(plain, '__wrapped__', None) is None, 'patched at import'\n"
            "m = torchnative.accelerate(torch.nn.Linear(2, 2))\n"
            "with torch.no_grad(): m(torch.randn(1, 2))\n"
            "assert torch.nn.Module.__setattr__ is not plain\n"
            "del m; gc.collect()\n"
            "assert torch.nn.Module.__setattr__ is plain, 'not given back'\n")
    gc.collect()
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]


@pytest.mark.parametrize("kind", ["forward", "forward_pre"])
def test_a_submodules_hook_runs_on_every_call(kind):
    """A hook inside the forward that computes with tensors (a forward hook whose ops are in the
    graph), or a pre-hook, is Python a replay would skip: such a call is recorded every time, and
    says why."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()
    seen = []
    if kind == "forward":
        handle = model[1].register_forward_hook(lambda m, i, o: seen.append(o.sum().item()))
    else:
        handle = model[1].register_forward_pre_hook(lambda m, i: seen.append(i[0].sum().item()))
    torchnative.accelerate(model, delegates=["eager"])
    torchnative.reset_stats()
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(6):
            model(x)
    assert len(seen) == 6 and len(set(seen)) == 1
    stats = torchnative.stats()
    assert stats["replays"] == 0
    assert any("hook on submodule '1'" in why for why in stats["replay_ineligible"]), stats["replay_ineligible"]
    handle.remove()  # gone: the calls replay again
    with torch.no_grad():
        for _ in range(4):
            model(x)
    assert torchnative.stats()["replays"] >= 1


def test_a_pre_hook_registered_after_the_calls_replay_runs_at_the_next_call():
    """Whether a submodule holds a hook is one pass over hook dicts listed once (replay/watch.py
    Submodules): a pre-hook registered once the calls replay is in them, so the next call runs it
    (a replay would skip it), with eager's result."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 2)).eval()
    reference = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["eager"])
    torchnative.reset_stats()
    x = torch.randn(2, 4)
    with torch.no_grad():
        for _ in range(4):
            model(x)
        assert torchnative.stats()["replays"] >= 1
        for m in (model, reference):
            m[2].register_forward_pre_hook(lambda m, args: (args[0] * 2,))
        for _ in range(3):
            assert torch.equal(model(x), reference(x))


def test_transformers_own_output_hooks_do_not_stop_replay():
    """`output_hidden_states=True` leaves transformers' capturing hooks on the layers; their
    effect reaches the caller through the call's output, which a replay rebuilds."""
    model = models.transformers_model("GPT2LMHeadModel", "tiny")
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 1000, (1, 8))
    with torch.no_grad():
        model(ids, output_hidden_states=True)
    assert any(m._forward_hooks for m in model.modules())
    torchnative.accelerate(model, delegates=["eager"])
    torchnative.reset_stats()
    with torch.no_grad():
        for _ in range(4):
            out = model(ids, output_hidden_states=True)
        want = ref(ids, output_hidden_states=True)
    assert torchnative.stats()["replays"] >= 1
    assert_same(out.logits, want.logits)
    for got, expected in zip(out.hidden_states, want.hidden_states, strict=True):
        assert_same(got, expected)


_TABLE_STEP = [0]


class Tables(torch.nn.Module):
    """Tensors a graph reads that are neither arguments nor weights: a table a method's
    lru_cache keeps (RT-DETR's position embeddings), shape entries written as Python ints
    (RT-DETR's `spatial_shapes[i, 0] = height`), and, per `fresh`, one made anew each call from
    numpy or from a global counter."""

    def __init__(self, fresh: str | None = None):
        super().__init__()
        self.lin, self.fresh = torch.nn.Linear(8, 8), fresh

    @functools.lru_cache(maxsize=4)
    def table(self, n: int) -> torch.Tensor:
        return torch.arange(n, dtype=torch.float32)[:, None] * torch.linspace(0, 1, 8) / n

    def forward(self, x):
        shapes = torch.empty(2, dtype=torch.long)
        shapes[0], shapes[1] = x.shape[0], x.shape[1]  # 0-dim tensors torch makes of Python ints
        y = self.lin(x) + self.table(x.shape[0]) + shapes.sum()
        if self.fresh == "numpy":
            y = y + torch.from_numpy(np.random.default_rng(_TABLE_STEP[0]).random(8, dtype=np.float32))
        elif self.fresh == "counter":
            step = torch.zeros(2)
            step[0] = _TABLE_STEP[0]
            y = y * step.sum()
        _TABLE_STEP[0] += 1
        return y


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
@pytest.mark.parametrize("fresh", [None, "numpy", "counter"])
def test_tables_python_keeps_or_makes_are_read_as_eager_reads_them(fresh, delegates):
    eager, accel = Tables(fresh), Tables(fresh)
    accel.load_state_dict(eager.state_dict())
    torchnative.accelerate(accel, delegates=delegates, compile_after=1)
    torchnative.reset_stats()
    xs = [torch.randn(6, 8) for _ in range(6)]
    with torch.no_grad():
        for x in xs:
            start = _TABLE_STEP[0]
            want = eager(x)
            _TABLE_STEP[0] = start  # the same step for both
            assert_same(accel(x), want, rtol=1e-5, atol=1e-6)
    s = torchnative.stats()
    # a table Python keeps replays; one it makes anew each call never does (a replay would reuse it)
    assert (s["replays"] > 0) == (fresh is None), s


class WritesBeforeACut(torch.nn.Module):
    """Train-mode BatchNorms on both sides of a cut (`if ... > 0` reads data), so the graph
    before the cut writes running statistics and a step counter the graph after it reads."""

    def __init__(self, view: bool = False):
        super().__init__()
        self.bn1, self.lin, self.bn2, self.view = torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4), view
        self.register_buffer("steps", torch.zeros(()))

    def forward(self, x):
        y = self.bn1(x)
        self.steps.add_(1)
        if y.abs().sum() > 0:
            y = y + 1
        z = self.bn2(self.lin(y)) * self.steps
        return z + self.bn1.running_mean[:2].sum() if self.view else z


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
@pytest.mark.parametrize("view", [False, True], ids=["written", "slice-of-written"])
def test_graphs_before_the_last_write_state_as_eager_does(view, delegates):
    eager = WritesBeforeACut(view).train()
    accel = copy.deepcopy(eager)
    torchnative.accelerate(accel, delegates=delegates, compile_after=1)
    torchnative.reset_stats()
    with torch.no_grad():
        for _ in range(6):
            x = torch.randn(8, 4)
            assert_same(accel(x), eager(x), rtol=1e-5, atol=1e-6)
    for name, b in eager.named_buffers():
        assert_same(dict(accel.named_buffers())[name], b, rtol=1e-5, atol=1e-6)
    # a replay writes at the end; the graph after the cut reads what the one before wrote (a
    # slice of it too: the slice is an op of that graph)
    assert torchnative.stats()["replays"] >= 3, torchnative.stats()


class Features(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.ReLU(),
                                        torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
        self.head = torch.nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.body(x))


def _actmad_step(model, feats: list, opt, x):
    """ActMAD's step: the hooked BatchNorm outputs' statistics pulled to fixed ones."""
    feats.clear()
    logits = model(x)
    loss = sum((f.mean(0) - 0.5).abs().mean() + (f.var(0) - 1).abs().mean() for f in feats)
    opt.zero_grad()
    loss.backward()
    opt.step()
    return logits.detach()


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_forward_hooks_that_keep_tensors_are_called_by_replay(delegates):
    """ActMAD's forward hooks append each BatchNorm's output to a list the loss reads: a replay
    calls them with the values its programs made, gradients flow through them, and a hook
    removed or added is seen."""
    torch.manual_seed(0)
    eager = Features().eval()
    accel = copy.deepcopy(eager)
    runs = []
    for model in (eager, accel):
        feats: list = []
        for m in model.modules():
            if isinstance(m, torch.nn.BatchNorm1d):
                m.register_forward_hook(lambda m, i, o, feats=feats: feats.append(o))
        runs.append((model, feats, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)))
    torchnative.accelerate(accel, delegates=delegates, background=False)
    torchnative.reset_stats()
    tol = dict(rtol=0, atol=0) if delegates == ["eager"] else dict(rtol=1e-4, atol=1e-5)
    declined = []  # eval-mode BatchNorm's saved statistics, which the backward reads, once made ORT's declined
    stop = torchnative.events.listen(
        lambda e: declined.append(e.reason) if isinstance(e, torchnative.events.Fallback) and e.reason.startswith("verify") else None)
    try:
        for step in range(8):
            x = torch.randn(16, 4, generator=torch.Generator().manual_seed(step))
            want, got = (_actmad_step(*run, x) for run in runs)
            assert_same(got, want, **tol)
            assert len(runs[1][1]) == 2 and all(f.requires_grad for f in runs[1][1])
    finally:
        stop()
    assert not declined, declined
    for p, q in zip(eager.parameters(), accel.parameters()):
        assert_same(q, p, **tol)
    assert torchnative.stats()["replays"] >= 3, torchnative.stats()
    # a hook taken away is not called by the replays after it
    seen = []
    handle = accel.body[1].register_forward_hook(lambda m, i, o: seen.append(o))
    with torch.no_grad():
        for _ in range(5):
            accel(torch.randn(16, 4))
    assert len(seen) == 5
    handle.remove()
    with torch.no_grad():
        for _ in range(5):
            accel(torch.randn(16, 4))
    assert len(seen) == 5


class FastWeightScan(torch.nn.Module):
    """A TTT-style scan as public libraries write it: an output buffer made before the loop and
    written step by step, a fast weight updated in the loop, a data check per step (a cut), and
    the final fast weight copied into a state the module keeps across calls."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)
        self.register_buffer("w0", torch.zeros(8, 8))

    def forward(self, x):
        out = torch.empty_like(x)
        w = self.w0
        for t in range(x.shape[0]):
            y = self.lin(x[t]) + x[t] @ w
            if torch.isnan(y).any():
                raise ValueError("nan")
            out[t] = y
            w = w + 0.01 * torch.outer(y, x[t])
        self.w0.copy_(w)
        return out


@pytest.mark.parametrize("delegates", DELEGATES, ids=lambda d: d[0])
def test_a_scan_writing_a_buffer_and_a_state_after_cuts_replays(delegates):
    eager = FastWeightScan()
    accel = copy.deepcopy(eager)
    torchnative.accelerate(accel, delegates=delegates, compile_after=1)
    torchnative.reset_stats()
    with torch.no_grad():
        for step in range(6):
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
            assert_same(accel(x), eager(x), rtol=1e-5, atol=1e-6)
            assert_same(accel.w0, eager.w0, rtol=1e-5, atol=1e-6)
    assert torchnative.stats()["replays"] >= 3, torchnative.stats()


class InPlaceViews(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        y = self.lin(x)
        y.unsqueeze_(0)  # the wrapper takes the view's metadata in place (recorder._set_meta)
        y.squeeze_(0).t_()
        return y * 2


@pytest.mark.parametrize("grad", [False, True])
def test_in_place_view_ops_on_recorded_values(grad):
    """x.unsqueeze_(), squeeze_(), t_() on a value the call made: recorded while `.data =` is
    watched (shim/data.py), which must not take the recorder's own metadata update for a user's."""
    eager = InPlaceViews()
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=["eager"])
    with torch.set_grad_enabled(grad):
        for _ in range(3):
            x = torch.randn(4, 8)
            assert_same(accel(x), eager(x))


@pytest.mark.parametrize("name", ["gpt2", "llama"])
@pytest.mark.parametrize("delegate", ["eager", "ort"])
def test_a_causal_lm_forward_that_returns_a_cache_it_made_replays(name, delegate):
    """`model(input_ids)` with the config's use_cache returns a DynamicCache the forward made: a
    replay makes the cache again, as eager's, and a continuation from it gives eager's logits."""
    torch.manual_seed(0)
    eager = models.build(name, "tiny").eval()
    model = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate])
    ids = torch.randint(1, 100, (1, 12))
    torchnative.reset_stats()
    with torch.no_grad():
        for _ in range(5):
            got, want = model(ids), eager(ids)
            assert_same(got.logits, want.logits, atol=1e-4)
            assert type(got.past_key_values) is type(want.past_key_values)
            for g, w in zip(got.past_key_values.layers, want.past_key_values.layers):
                assert_same(g.keys, w.keys, atol=1e-4)
                assert_same(g.values, w.values, atol=1e-4)
        nxt = torch.randint(1, 100, (1, 1))
        assert_same(eager(nxt, past_key_values=got.past_key_values).logits,
                    eager(nxt, past_key_values=want.past_key_values).logits, atol=1e-4)
    assert torchnative.stats()["replays"] >= 2, torchnative.stats()


def test_an_object_the_call_returns_again_is_not_made_anew():
    """A replay rebuilds only objects the call makes: one it returns call after call (kept by
    the module) stays that object."""
    class Box:
        def __init__(self):
            self.value = None

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.box = Box()

        def forward(self, x):
            return x * 2, self.box

    model = torchnative.accelerate(Model(), delegates=["eager"])
    torchnative.reset_stats()
    for _ in range(4):
        y, box = model(torch.ones(3))
        assert box is model.box and torch.equal(y, torch.ones(3) * 2)
    assert torchnative.stats()["replays"] == 0


def test_a_made_object_that_points_to_one_the_model_keeps_is_not_rebuilt():
    """A new object each call that holds one the model keeps (a cache pointing to the config):
    a replay would copy the kept one, so the call records, and the object it holds stays the model's."""
    class Config:
        def __init__(self):
            self.width = 3

    class Holder:
        def __init__(self, t, config):
            self.t, self.config = t, config

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.config = Config()

        def forward(self, x):
            return Holder(x * 2, self.config)

    model = torchnative.accelerate(Model(), delegates=["eager"])
    torchnative.reset_stats()
    for _ in range(4):
        out = model(torch.ones(3))
        assert out.config is model.config and torch.equal(out.t, torch.ones(3) * 2)
    assert torchnative.stats()["replays"] == 0


def test_an_object_with_slots_in_the_output_is_not_rebuilt():
    class Slotted:
        __slots__ = ("t",)

        def __init__(self, t):
            self.t = t

    class Model(torch.nn.Module):
        def forward(self, x):
            return Slotted(x * 2)

    model = torchnative.accelerate(Model(), delegates=["eager"])
    torchnative.reset_stats()
    for _ in range(4):
        assert torch.equal(model(torch.ones(3)).t, torch.ones(3) * 2)
    assert torchnative.stats()["replays"] == 0
    assert any("Slotted" in why for why in torchnative.stats()["replay_ineligible"])

"""Eager semantics under capture: views, in-place writes, aliasing, state, sync points."""
import pickle

import pytest
import torch

import torchnative
from tests.conftest import assert_same, run_both

CASES = {
    "elementwise": lambda x: (x * 2 + 1).relu().sum(-1),
    "inplace_on_lazy": lambda x: (lambda y: (y.add_(1), y.mul_(3), y)[-1])(x * 2),
    "inplace_on_real_input": lambda x: x.add_(1).mul(2),
    "setitem_slice_of_lazy": lambda x: (lambda y: (y.__setitem__((slice(None), slice(0, 2)), 7.0), y)[-1])(x.clone()),
    "view_sees_base_write": lambda x: (lambda y: (lambda v: (y.add_(10), v * 1)[-1])(y[1]))(x.clone()),
    "base_sees_view_write": lambda x: (lambda y: (y[0].mul_(0), y.sum())[-1])(x.clone()),
    "view_of_view_write": lambda x: (lambda y: (y.view(-1)[2:5].fill_(-1), y)[-1])(x.clone()),
    "transpose_write": lambda x: (lambda y: (y.t()[0].fill_(3), y)[-1])(x.clone()),
    "real_view_write": lambda x: (x[1].fill_(5), x * 1)[-1],
    "real_view_read_after_base_write": lambda x: (lambda v: (x.mul_(2), v + 0)[-1])(x[:, 1]),
    "dtype_cast_inplace": lambda x: (lambda y: (y.add_(x), y)[-1])(x.to(torch.float16)),
    "factories": lambda x: x + torch.arange(x.shape[-1]) + torch.full((1,), 2.0) + torch.tensor([1.0, 2.0, 3.0, 4.0]),
    "split_unbind": lambda x: [a.sum() for a in x.split(1)] + list(x.unbind(1)),
    "index_copy_state": lambda x, buf: (buf.index_copy_(0, torch.tensor([1]), x[:1]), buf.sum())[-1],
    "masked_fill_inplace": lambda x: x.clone().masked_fill_(x > 0, 0.0),
    "item_sync": lambda x: x * (x.sum().item() > 0),
    "bool_branch": lambda x: x + 1 if bool((x > 0).any()) else x - 1,
    "nonzero_cut": lambda x: x[x > 0].sum() + torch.nonzero(x).shape[0],
    "tolist": lambda x: torch.tensor((x * 2).tolist()) + x.sum(),
    "multi_output": lambda x: torch.nn.functional.layer_norm(x, (4,)),
    "sdpa": lambda x: torch.nn.functional.scaled_dot_product_attention(x[None, None], x[None, None], x[None, None]),
    "batch_norm_train": lambda x, rm: torch.nn.functional.batch_norm(x, rm, rm.clone() + 1, training=True),
}


@pytest.mark.parametrize("name", sorted(CASES))
def test_case_matches_eager(name):
    fn = CASES[name]
    args = [torch.randn(3, 4)]
    if fn.__code__.co_argcount == 2:
        args.append(torch.randn(3, 4) if name != "batch_norm_train" else torch.zeros(4))
    eout, eargs, cout, cargs = run_both(fn, *args)
    assert_same(cout, eout)
    assert_same(cargs, eargs)  # writes into real inputs were written back


def test_outputs_become_real_values():
    x = torch.randn(3)
    with torchnative.capture():
        y = x + 1
    assert torch.equal(y, x + 1)
    assert y.data_ptr() != 0
    assert (y.numpy() == (x + 1).numpy()).all()


def test_lazy_view_shares_memory_after_capture():
    x = torch.randn(3, 4)
    with torchnative.capture():
        y = x * 1
        v = y[0]
    v.fill_(0)  # outside capture: an eager write through a view
    assert torch.equal(y[0], torch.zeros(4))


def test_data_ptr_never_zero_inside_capture():
    with torchnative.capture():
        y = torch.ones(3) * 2
        assert y.data_ptr() != 0
        assert y.tolist() == [2.0, 2.0, 2.0]


def test_same_code_reuses_program():
    from torchnative.cache.program_cache import clear_caches

    clear_caches()  # another test may have run this graph already
    x = torch.randn(8)
    torchnative.reset_stats()
    for _ in range(3):
        with torchnative.capture(["eager"]):
            y = (x.sin() * 2).sum()
    s = torchnative.stats()
    assert s["graphs_built"] == 1 and s["cache_hits"] == 2
    assert torch.equal(y, (x.sin() * 2).sum())


def test_shape_error_is_eagers_error():
    a, b = torch.randn(2, 3), torch.randn(4, 5)
    with pytest.raises(RuntimeError, match="cannot be multiplied"):
        with torchnative.capture():
            a @ b


def test_run_time_error_names_op_and_line():
    weight, idx = torch.randn(5, 3), torch.tensor([1, 7])
    with pytest.raises(torchnative.CapturedOpError, match=r"aten\.embedding.*test_semantics\.py:\d+"):
        with torchnative.capture():
            out = torch.nn.functional.embedding(idx, weight)  # noqa: F841 (discarded results are not computed)


def test_run_time_error_is_also_of_eagers_type():
    """`except IndexError:` around code that indexes out of range catches it as in eager; the
    error still names the op, pickles (a worker process sends it back) and keeps its message."""
    weight, idx = torch.randn(5, 3), torch.tensor([1, 7])
    with pytest.raises(IndexError, match=r"aten\.embedding.*index out of range") as caught:
        with torchnative.capture():
            out = torch.nn.functional.embedding(idx, weight)  # noqa: F841
    assert isinstance(caught.value, torchnative.CapturedOpError)
    back = pickle.loads(pickle.dumps(caught.value))
    assert type(back) is type(caught.value) and str(back) == str(caught.value)
    assert str(caught.value).startswith("aten.embedding")  # not quoted as a KeyError's message would be


def test_inplace_cast_error_is_eagers():
    with pytest.raises(RuntimeError, match="can't be cast"):
        with torchnative.capture():
            torch.ones(3, dtype=torch.int64).add_(1.5)


def test_explain_reports_graphs_and_breaks_with_user_line():
    def f(x):
        y = x.sin() * 2
        if y.sum().item() > 0:  # graph break here
            y = y + 1
        return y.cos()

    x = torch.randn(6)
    e = torchnative.explain(f, x)
    assert len(e.graphs) == 2
    assert "aten.sin.default" in e.graphs[0].ops() and "aten.cos.default" in e.graphs[1].ops()
    assert len(e.breaks) == 1
    brk = e.breaks[0]
    assert brk.filename == __file__ and brk.op == "aten._local_scalar_dense.default"
    assert "if y.sum().item() > 0" in open(__file__).read().splitlines()[brk.line - 1]
    assert torch.allclose(e.output, f(x))
    assert e.op_counts["aten.sin.default"] == 1


def test_a_read_of_data_no_input_reaches_does_not_break_the_graph():
    """transformers reads `(positions.diff() != 1).cumsum(-1)[:, -1] == 0).all()` of an arange:
    its value follows from the recorded path alone, so the graph goes on; per path, not once."""
    def f(x):
        y = x.sin()
        if torch.arange(x.shape[0]).sum().item() > 10:  # 3 rows: 3; 6 rows: 15
            return y * 2
        return y * 3

    for rows in (3, 6, 3, 6):
        x = torch.randn(rows)
        e = torchnative.explain(f, x)
        assert not e.breaks and len(e.graphs) == 1, e.breaks
        torch.testing.assert_close(e.output, f(x), rtol=0, atol=0)
    with torchnative.capture(compile_after=1):  # recorded, then replayed
        for rows in (3, 6, 3, 6, 3, 6):
            x = torch.randn(rows)
            torch.testing.assert_close(f(x), x.sin() * (2 if rows == 6 else 3), rtol=0, atol=0)

    def g(x):  # the data comes from an input: Python's branch is a cut, as before
        return x * 2 if (x + torch.arange(3)).sum().item() > 0 else x * 3
    e = torchnative.explain(g, torch.ones(3))
    assert len(e.breaks) == 1 and e.breaks[0].op == "aten._local_scalar_dense.default"


def test_stats_count_syncs_by_reason():
    torchnative.reset_stats()
    x = torch.randn(4)
    with torchnative.capture():
        (x * 2).tolist()
        print_target = repr(x + 1)  # noqa: F841
    s = torchnative.stats()
    assert s["syncs"] == {".tolist()": 1, "repr/print": 1}
    assert s["ops_recorded"] == 2 and s["graph_runs"] == 2


def test_inference_mode_capture():
    model = torch.nn.Linear(4, 4)
    x = torch.randn(2, 4)
    with torch.inference_mode():
        ref = model(x)
        with torchnative.capture():
            out = model(x)
    assert torch.allclose(out, ref)



@pytest.mark.parametrize("view", [lambda x: x.view(16), lambda x: x[1:], lambda x: x.t(), lambda x: x.unsqueeze(0),
                                  lambda x: x.expand(2, 4, 4), lambda x: x.select(0, 1)],
                         ids=["view", "slice", "t", "unsqueeze", "expand", "select"])
def test_views_of_a_normal_tensor_recorded_in_inference_mode(view):
    """Eager's view of a normal tensor in inference mode is a normal tensor sharing its base's
    version counter, which torch sets on what the door returns: a pending view made as an
    inference tensor raised "Cannot set version_counter for inference tensor" (GPT-2's first
    op, `input_ids.view`, in any call recorded under torch.inference_mode())."""
    x = torch.randn(4, 4)
    with torch.inference_mode():
        v_ref = view(x)
        ref = v_ref * 2
        with torchnative.capture():
            v = view(x)
            out = v * 2
        assert torch.equal(out, ref)
        assert (v.is_inference(), out.is_inference()) == (v_ref.is_inference(), ref.is_inference()) == (False, True)


def test_a_tensor_made_from_data_in_inference_mode_is_recorded_as_eager_makes_it():
    """`torch.tensor([])` (a transformers cache's lazy init) runs `detach_` on its new tensor in
    inference mode; recorded as a write of the tensor into itself, reading it back recursed
    without end."""
    x = torch.randn(3)
    with torch.inference_mode():
        with torchnative.capture():
            empty = torch.tensor([])
            out = torch.cat([empty, x * 2])
        assert torch.equal(out, x * 2) and empty.shape == (0,) and empty.is_inference()


class _DropoutAttention(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.qkv, self.out, self.drop = torch.nn.Linear(16, 48), torch.nn.Linear(16, 16), torch.nn.Dropout(0.1)

    def forward(self, x):
        q, k, v = self.qkv(x).view(2, 5, 3, 2, 8).permute(2, 0, 3, 1, 4)
        a = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=0.1 if self.training else 0.0)
        return self.out(self.drop(a.transpose(1, 2).reshape(2, 5, 16)))


def test_dropout_and_attention_in_inference_mode_are_one_graph_as_under_no_grad():
    """Outside inference mode dropout and SDPA are decomposed above the door (at the Autograd
    key); in it they reach the door whole, and their random-op tag cut the graph at each: GPT-2
    recorded 8 graphs per call there (1 under no_grad), BERT 9. In train mode dropout still
    draws when eager draws, from the same generator."""
    torch.manual_seed(0)
    model, x = _DropoutAttention(), torch.randn(2, 5, 16)
    for train in (False, True):
        model.train(train)
        with torch.inference_mode():
            torch.manual_seed(1)
            ref = model(x)
            torch.manual_seed(1)
            explained = torchnative.explain(model, x)
        # its graph's ops may run on a delegate (explain compiles): a mask drawn otherwise would differ by far more
        assert torch.allclose(explained.output, ref, rtol=0, atol=1e-6)
        if not train:
            assert len(explained.graphs) == 1 and not explained.breaks

def test_backward_inside_capture_matches_eager():
    import copy
    torch.manual_seed(0)
    mlp = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.LayerNorm(16), torch.nn.Linear(16, 4))
    twin = copy.deepcopy(mlp)
    x = torch.randn(5, 8)
    mlp(x).pow(2).mean().backward()
    torch.optim.SGD(mlp.parameters(), lr=0.1).step()
    with torchnative.capture():
        twin(x).pow(2).mean().backward()
        torch.optim.SGD(twin.parameters(), lr=0.1).step()
    for p, q in zip(mlp.parameters(), twin.parameters()):
        assert torch.allclose(p.grad, q.grad, atol=1e-6)
        assert torch.allclose(p, q, atol=1e-6)

"""Ops the door records whole instead of decomposing (recording.ops.KEPT_WHOLE): torch's
decomposition of each rounds differently from its kernel, so on the eager delegate they equal eager
bit for bit only whole; ONNX Runtime still takes every one, with no partition left to eager; and
var / var_mean, which torchlib does not translate, are ours."""
import pytest
import torch
import torch.nn.functional as F

import torchnative
from torchnative.delegates import REGISTRY

_G = torch.Generator().manual_seed(0)
X = torch.randn(4, 16, 24, generator=_G) * 3
Y = torch.randn(4, 16, 24, generator=_G)
P = torch.rand(4, 16, 24, generator=_G) * 0.98 + 0.01  # in (0, 1)
W = torch.randn(24, generator=_G)
LABELS = torch.randint(0, 24, (16,), generator=_G)

# name: (call, the op kept whole); decomposed, each differs from eager on these inputs
FORWARD = {
    "silu": (lambda: F.silu(X), "silu"),
    "silu_inplace": (lambda: F.silu(X + 0, inplace=True), "silu"),
    "softplus": (lambda: F.softplus(X), "softplus"),
    "softplus_beta": (lambda: F.softplus(X, beta=2.0, threshold=5.0), "softplus"),
    "mish": (lambda: F.mish(X), "mish"),
    "logsigmoid": (lambda: F.logsigmoid(X), "log_sigmoid_forward"),
    "addcmul": (lambda: torch.addcmul(X, Y, P, value=0.3), "addcmul"),
    "addcmul_inplace": (lambda: (X + 0).addcmul_(Y, P, value=0.3), "addcmul"),
    "lerp_scalar": (lambda: torch.lerp(X, Y, 0.3), "lerp"),
    "lerp_tensor": (lambda: torch.lerp(X, Y, P), "lerp"),
    "xlogy": (lambda: torch.xlogy(X, P), "xlogy"),
    "sinc": (lambda: torch.sinc(X), "sinc"),
    "std": (lambda: X.std(-1), "std"),
    "std_mean": (lambda: torch.std_mean(X, [0, 2], correction=0), "std_mean"),
    "mv": (lambda: X[0] @ W, "mv"),
    "dot": (lambda: X[0, 0] @ Y[0, 0], "dot"),
    "addr": (lambda: torch.addr(X[0], X[0, :, 0], W), "addr"),
    "nll_loss": (lambda: F.nll_loss(F.log_softmax(X[0], -1), LABELS), "nll_loss_forward"),
    "cross_entropy": (lambda: F.cross_entropy(X[0], LABELS), "nll_loss_forward"),
}

# gradients: their backward kernels are kept too (a fast-weight layer takes them inside its forward)
BACKWARD = {
    "silu": F.silu, "mish": F.mish, "softplus": F.softplus, "logsigmoid": F.logsigmoid, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "elu": F.elu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "softmax": lambda x: F.softmax(x, -1), "log_softmax": lambda x: F.log_softmax(x, -1),
    "cross_entropy": lambda x: F.cross_entropy(x[0], LABELS), "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
}


def _captured(fn, delegate):
    torchnative.reset_stats()
    with torch.no_grad(), torchnative.capture([delegate], compile_after=1):
        e = torchnative.explain(fn)
    return e


def _placed(e) -> list[str]:
    return [d for parts in e.partitions for d, _ in parts]


def _recorded(e, op: str) -> bool:
    return any(k.split(".")[1] == op for k in e.op_counts)


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_kept_op_is_recorded_whole_and_equals_eager_bit_for_bit(name):
    fn, op = FORWARD[name]
    e = _captured(fn, "eager")
    assert _recorded(e, op), e.op_counts
    expected = fn()
    for got, want in zip(*(torch.utils._pytree.tree_leaves(v) for v in (e.output, expected))):
        assert torch.equal(got, want), (got - want).abs().max()


@pytest.mark.parametrize("name", sorted(FORWARD))
def test_ort_takes_the_kept_op_whole_with_no_eager_partition(name):
    fn, op = FORWARD[name]
    e = _captured(fn, "ort")
    assert _recorded(e, op), e.op_counts
    assert set(_placed(e)) == {"ort"} and not torchnative.stats()["fallbacks"], e
    torch.testing.assert_close(e.output, fn())


def _gradient(fn, delegate=None):
    x = X.clone().requires_grad_()
    seed = torch.randn(fn(X).shape, generator=torch.Generator().manual_seed(1))
    if delegate is None:
        return torch.autograd.grad(fn(x), x, seed)[0], None
    torchnative.reset_stats()
    with torchnative.capture([delegate], compile_after=1):
        e = torchnative.explain(lambda: torch.autograd.grad(fn(x), x, seed)[0] + 0)
    return e.output, e


@pytest.mark.parametrize("name", sorted(BACKWARD))
def test_gradients_equal_eager_bit_for_bit_on_eager_and_run_on_ort(name):
    expected, _ = _gradient(BACKWARD[name])
    got, _ = _gradient(BACKWARD[name], "eager")
    assert torch.equal(got, expected), (got - expected).abs().max()
    got, e = _gradient(BACKWARD[name], "ort")
    declined = [n.target for g in e.graphs for n in g.op_nodes() if not REGISTRY["ort"].supports(n)]
    # batch_norm's forward without running stats, which ort declines since the OpInfo sweep
    assert declined == ([torch.ops.aten._native_batch_norm_legit.no_stats] if name == "batch_norm" else []), declined
    assert not torchnative.stats()["fallbacks"]
    torch.testing.assert_close(got, expected)


def test_kept_ops_are_non_core_with_a_decomposition_each_delegate_can_lower():
    """A kept op is not Core ATen (those are recorded anyway) and has torch's decomposition, which
    a delegate whose toolchain lacks the op lowers it with; the ONNX export takes each."""
    from torch._decomp import core_aten_decompositions

    from torchnative.delegates.onnx_export import translated
    from torchnative.recording.ops import KEPT_WHOLE

    table = core_aten_decompositions()
    for op in KEPT_WHOLE:
        assert torch.Tag.core not in op.tags and op in table and not op._schema.is_mutable, op
        assert translated(op), op


VARIANCES = {
    "all": lambda x: torch.var(x),
    "last": lambda x: x.var(-1),
    "last_biased_keepdim": lambda x: x.var(-1, correction=0, keepdim=True),
    "dims": lambda x: x.var([0, 2], unbiased=False),
    "empty_dims_is_all": lambda x: x.var([]),
    "fractional_correction": lambda x: x.var(1, correction=2.5, keepdim=True),
    "correction_past_n": lambda x: x.var(0, correction=7),  # n - correction < 0: inf, as torch's max(0, ·)
    "var_mean": lambda x: torch.var_mean(x, -1),
    "var_mean_keepdim": lambda x: torch.var_mean(x, [1, 2], correction=0, keepdim=True),
    "std": lambda x: x.std(-1, keepdim=True),
    "std_mean": lambda x: torch.std_mean(x, 0, correction=0),
    "zero_dim": lambda x: x[0, 0, 0].var(correction=0),
}


@pytest.mark.filterwarnings("ignore:var\\(\\). degrees of freedom")  # correction_past_n, as eager warns
@pytest.mark.parametrize("name", sorted(VARIANCES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_var_runs_on_ort_like_eager(name, dtype):
    x = (X * 10 + 100).to(dtype)  # an offset mean: a one-pass sum of squares would cancel
    e = _captured(lambda: VARIANCES[name](x), "ort")
    assert _placed(e) == ["ort"] and not torchnative.stats()["fallbacks"], e
    torch.testing.assert_close(e.output, VARIANCES[name](x), equal_nan=True)


def test_var_of_float16_accumulates_in_float32_like_eager():
    x = (X * 10 + 100).half()
    e = _captured(lambda: torch.var_mean(x, -1), "ort")
    assert _placed(e) == ["ort"], e
    for got, want in zip(e.output, torch.var_mean(x, -1)):
        torch.testing.assert_close(got, want)

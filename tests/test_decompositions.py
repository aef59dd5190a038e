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
MULTILABELS = torch.cat([LABELS[:, None], (LABELS[:, None] + 5) % 24, torch.full((16, 22), -1)], 1)  # -1 ends a row

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
    "cross_entropy_2d": (lambda: F.cross_entropy(X, LABELS[:4, None].expand(4, 24) % 16), "nll_loss2d_forward"),
    "vdot": (lambda: torch.vdot(X[0, 0], Y[0, 0]), "vdot"),
    "binary_cross_entropy": (lambda: F.binary_cross_entropy(P, P.flip(0)), "binary_cross_entropy"),
    "soft_margin_loss": (lambda: F.soft_margin_loss(X, Y.sign()), "soft_margin_loss"),
    "multi_margin_loss": (lambda: F.multi_margin_loss(X[0], LABELS), "multi_margin_loss"),
    "linspace": (lambda: torch.linspace(-3.0, 5.0, 50), "linspace"),
    "logspace": (lambda: torch.logspace(-3.0, 2.0, 50), "logspace"),
}

# gradients: their backward kernels are kept too (a fast-weight layer takes them inside its forward)
BACKWARD = {
    "silu": F.silu, "mish": F.mish, "softplus": F.softplus, "logsigmoid": F.logsigmoid, "gelu": F.gelu,
    "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "elu": F.elu, "sigmoid": torch.sigmoid, "tanh": torch.tanh,
    "softmax": lambda x: F.softmax(x, -1), "log_softmax": lambda x: F.log_softmax(x, -1),
    "cross_entropy": lambda x: F.cross_entropy(x[0], LABELS),
    "cross_entropy_weighted": lambda x: F.cross_entropy(x[0], LABELS, weight=P[0, 0], ignore_index=3),
    "batch_norm": lambda x: F.batch_norm(x, None, None, training=True),
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
    # batch norm's backward, which ort declines as slower than eager's kernel
    assert declined == ([torch.ops.aten.native_batch_norm_backward.default] if name == "batch_norm" else []), declined
    assert not torchnative.stats()["fallbacks"]
    torch.testing.assert_close(got, expected)


class FastWeights(torch.nn.Module):
    """A Titans-style memory: per chunk, one gradient step of a SiLU MLP on a reconstruction loss,
    then the chunk read through the updated weights and normalized by its variance."""

    def __init__(self, d=16):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(d, 2 * d, generator=g) / d ** 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(2 * d, d, generator=g) / d ** 0.5)
        self.lr = torch.nn.Parameter(torch.tensor(0.1))

    def forward(self, x):
        w1, w2, out = self.w1, self.w2, []
        for chunk in x.split(4, dim=1):
            with torch.enable_grad():
                a, b = w1.detach().requires_grad_(), w2.detach().requires_grad_()
                loss = (F.silu(F.normalize(chunk, dim=-1) @ a) @ b - chunk).pow(2).mean()
                ga, gb = torch.autograd.grad(loss, (a, b))
            w1, w2 = w1 - F.softplus(self.lr) * ga, w2 - F.softplus(self.lr) * gb
            y = F.silu(chunk @ w1) @ w2
            out.append((y - y.mean(-1, keepdim=True)) * torch.rsqrt(y.var(-1, keepdim=True, correction=0) + 1e-5))
        return torch.cat(out, 1)


def test_a_fast_weight_layer_equals_eager_bit_for_bit_and_leaves_ort_no_kept_op():
    model, x = FastWeights(), torch.randn(2, 16, 16, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(x)
    e = _captured(lambda: model(x), "eager")
    assert torch.equal(e.output, expected)
    e = _captured(lambda: model(x), "ort")
    declined = {n.target for g in e.graphs for n in g.op_nodes() if not REGISTRY["ort"].supports(n)}
    assert declined == {torch.ops.aten.linalg_vector_norm.default}, declined  # F.normalize's, as before
    assert not torchnative.stats()["fallbacks"]
    torch.testing.assert_close(e.output, expected)


def test_multilabel_margin_loss_is_right_where_torchs_decomposition_is_not():
    """torch's decomposition counts the target slots past a row's -1 end marker (10x the loss here).
    Recorded whole, eager runs the kernel; ort, whose exporter would apply that decomposition,
    leaves the op to eager."""
    loss = lambda: F.multilabel_margin_loss(X[0], MULTILABELS)  # noqa: E731
    for delegate in ("eager", "ort"):
        e = _captured(loss, delegate)
        assert torch.equal(e.output, loss()) and not torchnative.stats()["fallbacks"], delegate
    assert _placed(e) == ["eager"], e


@pytest.mark.parametrize("fn", [F.softplus, F.mish], ids=["softplus", "mish"])
def test_float64_softplus_and_mish_run_on_ort_as_their_decomposition(fn):
    """torchlib translates both to Softplus, which ONNX Runtime has no float64 kernel of."""
    x = X.double()
    e = _captured(lambda: fn(x), "ort")
    assert set(_placed(e)) == {"ort"} and not torchnative.stats()["fallbacks"], e
    torch.testing.assert_close(e.output, fn(x))


def test_kept_ops_are_non_core_with_a_decomposition_each_delegate_can_lower():
    """A kept op is not Core ATen (those are recorded anyway) and has torch's decomposition, which
    a delegate whose toolchain lacks the op lowers it with; the ONNX export takes each but the one
    whose decomposition is wrong."""
    from torch._decomp import core_aten_decompositions

    from torchnative.delegates.onnx_export import translated
    from torchnative.recording.ops import KEPT_WHOLE

    table = core_aten_decompositions()
    for op in KEPT_WHOLE:
        assert torch.Tag.core not in op.tags and op in table and not op._schema.is_mutable, op
        assert translated(op) == (op is not torch.ops.aten.multilabel_margin_loss_forward.default), op


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

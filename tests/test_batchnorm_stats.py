"""Train-mode BatchNorm statistics re-estimated on a depthwise-separable CNN (TTA stage 0), every
call checked against an eager copy: the running statistics, `num_batches_tracked` and the outputs,
for the BatchNorm variants the ResNet case (tests/test_pinning.py) leaves out."""
import copy

import pytest
import torch
from torch import nn

import torchnative

# delegate -> tolerances: eager runs eager's kernels; ONNX Runtime's convolutions round differently,
# and how much depends on where the partitions end (a BatchNorm reading a changing momentum runs on
# eager, one with a constant momentum is fused into ONNX Runtime's graph): 1.1e-6 seen on 0.009
TOLERANCES = {"eager": dict(rtol=0, atol=0), "ort": dict(rtol=1e-5, atol=1e-5)}

VARIANTS = {
    "momentum": {},
    "momentum_none": dict(momentum=None),  # a cumulative average: the factor is 1 / num_batches_tracked
    "no_affine": dict(affine=False),
    "momentum_none_no_affine": dict(momentum=None, affine=False),
    "untracked": dict(track_running_stats=False),  # batch statistics in eval mode too
}

# T: a train-mode call on a new batch (statistics re-estimated), E: an eval-mode prediction; under
# torch.no_grad(), or in lower case under torch.inference_mode()
SCHEDULES = {
    "adapt_then_predict": "TTTTTTEEE",
    "predict_adapt_predict": "EETTTTTTEEE",  # programs for eval mode exist before the statistics change
    "interleaved": "TETETETETE",  # a prediction after each adaptation step
    "adapt_in_inference_mode": "EEttttttEEEtete",  # where the door sees batch_norm's kernel choice
}


@pytest.fixture(scope="module", autouse=True)
def shared_cache(tmp_path_factory):
    """One disk cache for the module: train-mode BatchNorm splits the block into ~9 ONNX partitions
    (~3 s each to export), which the tests of a variant share."""
    torchnative.set_cache_dir(tmp_path_factory.mktemp("batchnorm-cache"))
    yield
    torchnative.set_cache_dir(None)


class MobileNetBlock(nn.Module):
    """Conv 3x3 stride 2 → BN → ReLU6 → depthwise conv → BN → ReLU6 → pointwise conv → BN."""

    def __init__(self, **bn):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(8, **bn)
        self.depthwise = nn.Conv2d(8, 8, 3, padding=1, groups=8, bias=False)
        self.bn2 = nn.BatchNorm2d(8, **bn)
        self.pointwise = nn.Conv2d(8, 16, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(16, **bn)
        self.act = nn.ReLU6()

    def forward(self, x):
        x = self.act(self.bn1(self.conv(x)))
        x = self.act(self.bn2(self.depthwise(x)))
        return self.bn3(self.pointwise(x))


def _model(bn: dict) -> MobileNetBlock:
    torch.manual_seed(0)
    model = MobileNetBlock(**bn)
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d) and m.affine:  # not the identity they start as
                m.weight.uniform_(0.5, 1.5)
                m.bias.uniform_(-0.3, 0.3)
    return model


def _statistics(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.state_dict().items() if k.rsplit(".", 1)[-1] in
            ("running_mean", "running_var", "num_batches_tracked")}


def _cases() -> list:
    """Every variant × schedule × delegate; on ort the variant that combines two others (a
    cumulative average without affine parameters, 5-11 s a schedule) under -m slow."""
    return [pytest.param(v, s, d, marks=[pytest.mark.slow] if (v, d) == ("momentum_none_no_affine", "ort") else [])
            for d in TOLERANCES for s in SCHEDULES for v in VARIANTS]


@pytest.mark.parametrize("variant, schedule, delegate", _cases())
def test_batchnorm_statistics_reestimated_like_eager(variant, schedule, delegate):
    eager = _model(VARIANTS[variant])
    accel = torchnative.accelerate(copy.deepcopy(eager), delegates=[delegate])
    g = torch.Generator().manual_seed(3)
    test_batch = torch.randn(2, 3, 16, 16, generator=g)
    tol = TOLERANCES[delegate]
    for i, mode in enumerate(SCHEDULES[schedule]):
        train = mode in "Tt"
        eager.train(train)
        accel.train(train)
        x = torch.randn(4, 3, 16, 16, generator=g) * 1.5 + 0.3 if train else test_batch
        with torch.inference_mode() if mode.islower() else torch.no_grad():
            torch.testing.assert_close(accel(x), eager(x), **tol, msg=lambda m: f"call {i} ({mode}): {m}")
        expected = _statistics(eager)
        got = _statistics(accel)
        assert got.keys() == expected.keys()
        for name, value in expected.items():
            torch.testing.assert_close(got[name], value, **tol, msg=lambda m: f"{name} after call {i} ({mode}): {m}")

"""Python reads of a lazy tensor's data — `numpy()`, `__array__`, DLPack, buffers, `tolist()`,
`data_ptr()` — give eager's values with eager's strides, on lazy tensors and lazy views, inside
`capture()` and an accelerated forward, before and after the graph is compiled (issue 26)."""
import ctypes
import subprocess
import sys

import numpy as np
import pytest
import torch

import torchnative
from tests.conftest import assert_same

# eager's own Tensor.__array__ takes no `copy`, which numpy warns of on every np.array(tensor)
pytestmark = pytest.mark.filterwarnings("ignore:__array__ implementation doesn't accept a copy keyword")

SHAPE = (2, 3, 4, 5)


def _written_after_view(x):
    y = x + 1.0
    v = y[0].transpose(0, 2)
    y.mul_(3)
    return v


def _input_written_after_view(x):
    v = x[1, :, 1:3]
    x.add_(2)  # the forward's own (real) input
    return v


def _view_read_after_cut_and_base_write(x):
    y = x * 2.0
    v = y[0].transpose(0, 2)
    y.nonzero()  # a cut inside the dispatcher materializes the view
    y.add_(1)
    return v * 1


def _base_read_after_cut_and_view_write(x):
    y = x * 2.0
    v = y[1, :, 2]
    y.nonzero()
    v.mul_(-1)
    return y * 1


# what is read: a lazy tensor, or one of its views
CASES = {
    "tensor": lambda x: x * 2.0,
    "slice": lambda x: (x * 2.0)[:, 1:],
    "permute": lambda x: (x * 2.0)[0].permute(1, 2, 0),
    "transpose": lambda x: (x * 2.0)[0, 0].transpose(0, 1),
    "expand": lambda x: (x * 2.0)[0, 0, :1].expand(3, 5),
    "view_of_view": lambda x: (x * 2.0)[1][2][1:3],
    "strided_slice": lambda x: (x * 2.0)[..., ::2],
    "view_of_input": lambda x: x[0].permute(1, 2, 0),
    "written_after_view": _written_after_view,
    "input_written_after_view": _input_written_after_view,
    "view_read_after_cut_and_base_write": _view_read_after_cut_and_base_write,
    "base_read_after_cut_and_view_write": _base_read_after_cut_and_view_write,
    "to_pil_image": lambda x: x[0].permute(1, 2, 0).mul(255).byte(),  # torchvision's ToPILImage
}


def _at_data_ptr(t):
    """The tensor as its data pointer and strides address it, read through ctypes."""
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    size = t.element_size()
    raw = np.frombuffer((ctypes.c_char * (span * size)).from_address(t.data_ptr()), np.dtype(str(t.dtype)[6:]))
    return np.lib.stride_tricks.as_strided(raw, t.shape, [s * size for s in t.stride()]).copy()


READS = {
    "numpy": lambda t: t.numpy(),
    "numpy_force": lambda t: t.numpy(force=True),
    "asarray": np.asarray,
    "asarray_dtype": lambda t: np.asarray(t, dtype=np.float64),
    "array_copies": lambda t: (np.array(t), np.shares_memory(np.array(t), t.numpy())),
    "np_from_dlpack": np.from_dlpack,
    "torch_from_dlpack": torch.from_dlpack,
    "dunder_dlpack": lambda t: torch.from_dlpack(t.__dlpack__()),
    "tolist": lambda t: t.tolist(),
    "memoryview": lambda t: memoryview(t.numpy()),
    "bytes": lambda t: bytes(t.numpy()),
    "data_ptr": _at_data_ptr,
}


def _comparable(v):
    """What must equal eager's: dtype, shape, strides and values, read after all calls ran (a
    later call must not have overwritten an earlier call's memory)."""
    if isinstance(v, np.ndarray):
        return "ndarray", v.dtype, v.shape, v.strides, v.tobytes()
    if isinstance(v, torch.Tensor):
        return "tensor", v.dtype, v.shape, v.stride(), _comparable(v.numpy())
    if isinstance(v, memoryview):
        return "memoryview", v.format, v.shape, v.strides, v.tobytes()
    if isinstance(v, tuple):
        return tuple(_comparable(a) for a in v)
    return v


def _inputs():
    return torch.randn(SHAPE, generator=torch.Generator().manual_seed(0))


def _eager(case, read):
    return _comparable(READS[read](CASES[case](_inputs())))


class Reader(torch.nn.Module):
    def __init__(self, case, read):
        super().__init__()
        self.case, self.read = CASES[case], READS[read]

    def forward(self, x):
        return self.read(self.case(x))


def _in_capture(case, read, delegate, compile_after, calls):
    outs = []
    for _ in range(calls):
        with torchnative.capture(delegates=[delegate], compile_after=compile_after):
            outs.append(READS[read](CASES[case](_inputs())))
    return outs


def _in_forward(case, read, delegate, calls):
    model = torchnative.accelerate(Reader(case, read), delegates=[delegate])
    return [model(_inputs()) for _ in range(calls)]


PATHS = {
    "capture": lambda case, read, d: _in_capture(case, read, d, compile_after=2, calls=1),
    "capture_compiled": lambda case, read, d: _in_capture(case, read, d, compile_after=1, calls=3),
    "forward_compiled": lambda case, read, d: _in_forward(case, read, d, calls=3),
}


@pytest.mark.parametrize("delegate", ["eager", "ort"])
@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("read", sorted(READS))
@pytest.mark.parametrize("case", sorted(CASES))
def test_read_matches_eager(case, read, path, delegate):
    want = _eager(case, read)
    for got in PATHS[path](case, read, delegate):
        assert _comparable(got) == want


@pytest.mark.parametrize("delegate", ["eager", "ort"])
@pytest.mark.parametrize("path", sorted(PATHS))
def test_to_pil_image_pattern(path, delegate, monkeypatch):
    Image = pytest.importorskip("PIL.Image", reason="Pillow is not installed")
    monkeypatch.setitem(READS, "pil_image", lambda t: np.asarray(Image.fromarray(t.numpy())))
    want = _eager("to_pil_image", "pil_image")
    for got in PATHS[path]("to_pil_image", "pil_image", delegate):
        assert _comparable(got) == want


def test_numpy_of_tensor_requiring_grad_refuses_as_eager():
    w = torch.ones(5, requires_grad=True)
    with pytest.raises(RuntimeError, match="requires grad") as eager:
        (_inputs() * w)[0].numpy()
    with torchnative.capture():
        y = (_inputs() * w)[0]
        with pytest.raises(RuntimeError) as captured:
            y.numpy()
        forced = y.numpy(force=True).copy()
    assert str(captured.value) == str(eager.value)
    np.testing.assert_array_equal(forced, (_inputs() * w)[0].detach().numpy())


def test_legacy_to_dlpack_of_lazy_tensor_raises():
    """`torch.utils.dlpack.to_dlpack` reads the wrapper in C++, where the door cannot run the graph
    first: it must raise, not export memory that is not there (run apart: a crash is a failure)."""
    code = (
        "import torch, torchnative\n"
        "with torchnative.capture():\n"
        "    y = torch.randn(3, 4) * 2\n"
        "    try:\n"
        "        torch.from_dlpack(torch.utils.dlpack.to_dlpack(y)).sum().item()\n"
        "    except RuntimeError as e:\n"
        "        print('raised:', e)\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("raised: Cannot access data pointer"), run.stdout


def test_numpy_of_real_tensor_in_capture_reads_it_as_eager():
    """A real tensor's `numpy()` is torch's C++, whose inner `detach` passed the door and came back
    pending, without memory: it raised "Cannot access data pointer". It reads the tensor, after the
    writes the pending graph makes to it, and shares its memory as eager's does."""
    x, w = _inputs(), torch.ones(5)
    with torchnative.capture():
        y = x * 2
        view = x.numpy()
        w.add_(1)  # pending: runs before w's numpy
        w_now = np.asarray(w).copy()
        z = y + torch.from_numpy(view.copy())
    assert np.shares_memory(view, x.numpy())
    np.testing.assert_array_equal(w_now, np.full(5, 2.0, np.float32))
    assert torch.equal(z, x * 3)


class _NumpyStats(torch.nn.Module):
    """Normalizes by statistics kept as a buffer and read through numpy, as preprocessing code does."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.zeros(5))

    def forward(self, x):
        shift = float(np.asarray(self.mean).sum())
        return (x - self.mean) * 2 + shift


def test_numpy_of_a_buffer_inside_an_accelerated_forward_equals_eager_on_every_call():
    """The call reads data in Python, so it never replays: a change to the buffer between calls
    is seen, as eager sees it."""
    model, twin = _NumpyStats(), torchnative.accelerate(_NumpyStats(), delegates=["ort"])
    with torch.no_grad():
        for i in range(5):
            for m in (model, twin):
                m.mean.fill_(float(i))
            x = _inputs() + i
            assert_same(twin(x), model(x), atol=1e-6, rtol=1e-6)

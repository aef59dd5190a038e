import contextlib
import copy
import os

import pytest
import torch

# compiled partitions are not shared between tests (or with the user's cache) unless a test asks
os.environ.setdefault("TORCHNATIVE_CACHE_DIR", "off")
# programs compile in the call that needs them (the default), so a test knows which program ran;
# the tests of background compiles (tests/test_background_compile.py) ask for it
os.environ.setdefault("TORCHNATIVE_BACKGROUND_COMPILE", "0")
# a graph compiles on its second run (not by the cost rule's estimate), so a test knows when its
# program compiles; tests/test_cost_rule.py checks the rule itself
os.environ.setdefault("TORCHNATIVE_COMPILE_AFTER", "2")

import torchnative  # noqa: E402


def _clone(x):
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    return copy.deepcopy(x)


def assert_same(a, b, rtol=1e-5, atol=1e-6):
    """Same pytree structure; tensors of the same dtype/shape with close values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), (type(a), type(b))
        assert a.dtype == b.dtype and a.shape == b.shape, (a.dtype, b.dtype, a.shape, b.shape)
        torch.testing.assert_close(a.detach(), b.detach(), rtol=rtol, atol=atol, equal_nan=True)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            assert_same(x, y, rtol, atol)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k], rtol, atol)
    else:
        assert a == b, (a, b)


@contextlib.contextmanager
def record(*kinds):
    """The events of these kinds emitted inside the block, in order."""
    seen = []
    stop = torchnative.events.listen(lambda e: seen.append(e) if isinstance(e, kinds) else None)
    try:
        yield seen
    finally:
        stop()


def run_both(fn, *args):
    """fn eagerly and under capture() on separate copies of args: (eager out, eager args,
    captured out, captured args)."""
    eargs = [_clone(a) for a in args]
    cargs = [_clone(a) for a in args]
    eout = fn(*eargs)
    with torchnative.capture():
        cout = fn(*cargs)
    return eout, eargs, cout, cargs


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


# Every partition the build's check (build/verify.py) declined in this run, with its delegate,
# size, gap and the test that built it: delegate bugs to fix next, listed at the end of the run
_DECLINED: list = []


@pytest.fixture(autouse=True, scope="session")
def _declined_partitions():
    def seen(e):
        if isinstance(e, torchnative.events.Fallback) and e.reason.startswith("verify"):
            _DECLINED.append((e, os.environ.get("PYTEST_CURRENT_TEST", "?").split(" ")[0]))
    stop = torchnative.events.listen(seen)
    yield
    stop()


def pytest_terminal_summary(terminalreporter):
    if _DECLINED:
        terminalreporter.section("partitions the build's check declined (build/verify.py)")
        for e, test in _DECLINED:
            terminalreporter.write_line(f"{e.delegate}, {e.n_ops} ops, graph {e.graph_key[:12]} ({test}): {e.reason}")


@pytest.fixture(autouse=True)
def _no_vulkan_device_left_polling():
    """A test's Vulkan programs go when it ends: each holds IREE's Vulkan device, whose queue
    threads poll (two cores busy on lavapipe) for as long as it lives (delegates/iree.py), and
    would slow every test after it."""
    yield
    from torchnative.delegates import iree

    lease = iree._devices.get("vulkan")
    if lease is not None and lease() is not None:
        import gc

        from torchnative.cache.program_cache import clear_caches

        clear_caches()
        gc.collect()

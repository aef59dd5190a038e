"""The IREE delegates (`vulkan`, `iree-cpu`) beyond the shared delegate table (tests/test_delegates.py
runs their claimed ops and the models against eager): what they report here, what the probe finds
each target cannot compile, and weights that stay out of the artifact."""
import pytest
import torch

import torchnative
from torchnative import events
from torchnative.delegates import REGISTRY
from tests.conftest import record

STATUS = {name: REGISTRY[name].available() for name in ("vulkan", "iree-cpu")}
needs = {name: pytest.mark.skipif(s.status != "executes", reason=f"{name}: {s.reason}") for name, s in STATUS.items()}


def _attention(q: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(q, q, q, is_causal=True) * 2


def _run(delegate: str, fn, *args):
    with torch.no_grad(), record(events.Fallback, events.GraphRun) as seen, torchnative.capture([delegate], compile_after=1):
        e = torchnative.explain(fn, *args)
    placed = [p for r in seen if isinstance(r, events.GraphRun) for p in r.partitions]
    return e, placed, [f for f in seen if isinstance(f, events.Fallback)]


@needs["vulkan"]
def test_vulkan_says_when_it_is_software():
    devices = __import__("iree.runtime").runtime.get_driver("vulkan").query_available_devices()
    if any("llvmpipe" in d["name"] for d in devices):
        assert "software Vulkan" in STATUS["vulkan"].reason and "lavapipe" in STATUS["vulkan"].reason


@needs["iree-cpu"]
def test_iree_cpu_compiles_attention_whole():
    q = torch.randn(1, 2, 8, 16)
    e, placed, fallbacks = _run("iree-cpu", _attention, q)
    torch.testing.assert_close(e.output, _attention(q), rtol=1e-5, atol=1e-6)
    assert placed == [("iree-cpu", 2)] and not fallbacks


@needs["vulkan"]
def test_vulkan_declines_what_its_compiler_cannot_take_with_the_compilers_words():
    q = torch.randn(1, 4, 16, 16)  # GPT-2 tiny's causal attention; at 8 positions it compiles
    e, placed, fallbacks = _run("vulkan", _attention, q)
    torch.testing.assert_close(e.output, _attention(q), rtol=1e-5, atol=1e-6)
    assert placed == [("eager", 1), ("vulkan", 1)] and not fallbacks
    (op, delegate, reason), = e.programs[0].declined
    assert "flash_attention" in op and delegate == "vulkan"
    assert reason.startswith("IREE (vulkan-spirv) did not take it when compiled alone: failed to legalize")


@needs["iree-cpu"]
def test_weights_are_arguments_not_part_of_the_artifact():
    x = torch.randn(2, 256)
    mlp = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 8))
    with torch.no_grad(), record(events.PartitionCompiled) as built, torchnative.capture(["iree-cpu"], compile_after=1):
        y = mlp(x)
    torch.testing.assert_close(y, mlp(x), rtol=1e-5, atol=1e-5)
    step = next(e.step for e in built if e.step.delegate == "iree-cpu")
    weight_bytes = sum(p.numel() * 4 for p in mlp.parameters())
    assert step.artifact_bytes < weight_bytes / 4  # the code alone; the weights are uploaded at load


@needs["vulkan"]
def test_the_vulkan_device_goes_with_the_last_program_on_it():
    """IREE's Vulkan device polls its queues on two threads while it lives (two cores busy on
    lavapipe): it lives while a program holds it, not for the rest of the process."""
    import gc
    import time

    from torchnative.cache.program_cache import clear_caches
    from torchnative.delegates import iree

    mlp = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU())
    x = torch.randn(2, 16)
    with torch.no_grad(), torchnative.capture(["vulkan"], compile_after=1):
        y = mlp(x)
    torch.testing.assert_close(y, mlp(x), rtol=1e-5, atol=1e-5)
    assert iree._devices["vulkan"]() is not None
    clear_caches()
    gc.collect()
    assert iree._devices["vulkan"]() is None
    before, started = time.process_time(), time.perf_counter()
    time.sleep(0.5)
    busy = (time.process_time() - before) / (time.perf_counter() - started)
    assert busy < 0.5, f"the process kept {busy:.1f} cores busy while idle"

"""Programs compiled off the critical path (issue 22): while a graph's program compiles on the
background thread the graph runs on eager, outputs stay eager's throughout, the program is used
once ready, and a weight written while it compiled is never served stale."""
from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import torch

import torchnative
from torchnative import models, sizes, threads
from tests.conftest import assert_same
from tests.test_tta import METHODS, _images, _resnet
from torchnative.build import apart
from torchnative.interface import Artifact
from torchnative.cache import program_cache
from torchnative.cache.program_cache import background, clear_caches, programs
from torchnative.recording.trie import Recorded

ORT = dict(rtol=1e-4, atol=1e-4)


def _mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 8))


def _compiled(model_programs) -> list:
    return [p for p in model_programs if any(d == "ort" for d, _ in p.partitions)]


def _gated_builds(monkeypatch) -> threading.Event:
    """Background builds wait for the returned event (eager's, in the call, do not): the test
    decides what happens meanwhile."""
    gate, build = threading.Event(), program_cache.build_program

    def gated(*args, **kwargs):
        if threading.current_thread().name.startswith("torchnative-compile-background"):
            assert gate.wait(60), "the test never opened the gate"
        return build(*args, **kwargs)
    monkeypatch.setattr(program_cache, "build_program", gated)
    return gate


def _gated_and_watched(monkeypatch) -> tuple[threading.Event, list, object]:
    """A cold start with gated builds (`_gated_builds`), and every graph run's (replayed,
    partitions) listed from here; the third: stops the listing."""
    clear_caches()
    torchnative.reset_stats()
    runs: list = []
    stop = torchnative.events.listen(lambda e: isinstance(e, torchnative.events.GraphRun)
                                     and runs.append((e.replayed, e.partitions)))
    return _gated_builds(monkeypatch), runs, stop


def test_calls_run_on_eager_while_the_program_compiles_then_on_it(monkeypatch):
    model = _mlp()
    eager = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], background=True)
    gate, runs, stop = _gated_and_watched(monkeypatch)
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(8)]
    try:
        with torch.no_grad():
            for x in xs[:5]:  # the second call starts the compile; it cannot finish before the gate opens
                assert_same(model(x), eager(x), **ORT)
            assert not _compiled(programs()) and torchnative.stats()["compiling_runs"] >= 1
            # calls on eager's stand-in replay it meanwhile (the same trace twice in a row): not recorded again
            assert [r for r, _ in runs[-2:]] == [True, True], runs
            gate.set()
            torchnative.wait_for_compiles()
            runs.clear()
            for x in xs[5:]:
                assert_same(model(x), eager(x), **ORT)
    finally:
        stop()
    # the build is done: the replays run its program, as a recording of the call would
    assert len(_compiled(programs())) == 1 and torchnative.stats()["replay_misses"] == 0
    assert [r for r, _ in runs] == [True] * 3, runs
    assert all(any(d == "ort" for d, _ in parts) for _, parts in runs), runs


def test_decode_steps_replay_eagers_program_while_theirs_compiles_and_the_built_one_after(monkeypatch):
    """Chat traffic while the compile is out: `generate()` at new prompt lengths replays its decode
    steps on eager's (template) program instead of recording each again; once the build is done,
    the same replays run the built program. Tokens are eager's throughout."""
    model = models.build("gpt2")
    accel = torchnative.accelerate(copy.deepcopy(model), delegates=["ort"], background=True, compile_after=2)
    gate, runs, stop = _gated_and_watched(monkeypatch)
    kwargs = dict(max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=0)

    def chat(lengths):
        replayed = []
        for n in lengths:
            ids = torch.randint(0, 999, (1, n), generator=torch.Generator().manual_seed(n))
            before = torchnative.stats()["new_size_replays"]
            with torch.no_grad():
                assert torch.equal(accel.generate(ids, **kwargs), model.generate(ids, **kwargs))
            replayed.append(torchnative.stats()["new_size_replays"] - before)
        return replayed

    try:
        while_compiling = chat([12, 40, 24, 30])  # 24 and 30's decode lengths lie inside 13..49
        assert not _compiled(programs()) and torchnative.stats()["compiling_runs"] >= 1
        assert min(while_compiling[2:]) >= 5, while_compiling
        gate.set()
        torchnative.wait_for_compiles()
        runs.clear()
        after = chat([20, 35])
    finally:
        stop()
    assert min(after) >= 5 and _compiled(programs()), after
    replays = [parts for replayed, parts in runs if replayed]
    assert replays and all(any(d == "ort" for d, _ in parts) for parts in replays[-5:]), replays[-5:]


def test_calls_at_ever_new_sizes_while_compiling_are_weighed_against_eager(monkeypatch):
    """A call whose trace would replay eager's stand-in is no step towards a compiled replay: calls
    at sizes that never recur are weighed against eager (replay/worth.py) and run as eager, not
    recorded one after another (a tiny GPT-2 at 1000 random sizes grew 172 MB instead of 49)."""
    monkeypatch.setattr(program_cache, "_COMPILE_FLOOR", 0.0)  # the cost rule compiles at once: stand-ins
    monkeypatch.setattr(program_cache, "_SECONDS_PER_OP", 0.0)
    model = models.build("gpt2")
    model.config.use_cache = False
    eager = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], background=True, compile_after=None)
    gate, _, stop = _gated_and_watched(monkeypatch)
    stop()
    rng = torch.Generator().manual_seed(0)
    try:
        with torch.no_grad():
            for n in torch.randperm(60, generator=rng)[:40] + 8:
                ids = torch.randint(0, 999, (2, int(n)), generator=rng)
                assert torch.equal(model(ids).logits, eager(ids).logits)
        s = torchnative.stats()
        assert not _compiled(programs()) and s["compiling_runs"] >= 1, s
        assert s["eager_calls"] >= 10, s
    finally:
        gate.set()


def test_a_background_build_makes_its_graph_on_the_compile_thread(monkeypatch):
    """Building the fx graph of a program to compile is part of the compile, off the call."""
    made_on, real = [], Recorded.graph
    monkeypatch.setattr(Recorded, "graph", lambda self, *a: made_on.append(threading.current_thread().name) or real(self, *a))
    model = _mlp()
    torchnative.accelerate(model, delegates=["ort"], background=True)
    clear_caches()
    with torch.no_grad():
        for i in range(4):
            model(torch.randn(4, 16))
        torchnative.wait_for_compiles()
        model(torch.randn(4, 16))  # takes the program built
    assert _compiled(programs())
    assert "MainThread" in made_on  # eager's program, which the first calls run
    assert any(name.startswith("torchnative-compile-background") for name in made_on), made_on


def test_accelerate_starts_what_onnx_compiles_need_once_on_the_compile_thread(monkeypatch):
    """accelerate() with background builds gives the compile thread the ONNX delegates' one-time
    work (the exporter's imports and torchlib's registry) once per process and delegate, done
    while the caller pauses or once other work is given the thread; with builds in the call,
    nothing is given."""
    from torchnative.delegates import ort, qnn

    ran, submitted = [], []
    monkeypatch.setattr(program_cache, "_prepared", set())
    monkeypatch.setattr(program_cache, "_to_prepare", [])
    for d in (ort.delegate, qnn.delegate):
        monkeypatch.setattr(d, "prepare", lambda name=d.name: ran.append((name, threading.current_thread().name)), raising=False)
    real = program_cache._background.submit
    monkeypatch.setattr(program_cache._background, "submit", lambda fn, *a: submitted.append(fn) or real(fn, *a))
    torchnative.accelerate(_mlp(), delegates=["ort"], background=False)
    assert not submitted
    monkeypatch.setattr(program_cache._switch, "last_end", time.perf_counter())  # a call just made
    torchnative.accelerate(_mlp(), background=True)  # the default delegates: ort
    torchnative.accelerate(_mlp(), delegates=["ort", "qnn"], background=True)
    time.sleep(program_cache._IDLE_S / 4)
    assert not ran  # the caller may call again: it waits
    time.sleep(program_cache._IDLE_S)
    torchnative.wait_for_compiles()
    assert [name for name, _ in ran] == ["ort", "qnn"] and len(submitted) == 2  # one job, and wait_for_compiles' own
    assert all(thread.startswith("torchnative-compile-background") for _, thread in ran)


def test_the_one_time_work_waiting_for_a_pause_never_holds_up_wait_for_compiles(monkeypatch):
    """Before any call (no pause to wait for yet), wait_for_compiles() returns: the work it queues
    behind the waiting one-time work lets that run now."""
    from torchnative.delegates import ort

    ran = []
    monkeypatch.setattr(program_cache, "_prepared", set())
    monkeypatch.setattr(program_cache, "_to_prepare", [])
    monkeypatch.setattr(ort.delegate, "prepare", lambda: ran.append(1), raising=False)
    monkeypatch.setattr(program_cache._switch, "last_end", 0.0)
    torchnative.accelerate(_mlp(), delegates=["ort"], background=True)
    started = time.perf_counter()
    torchnative.wait_for_compiles()
    assert ran == [1] and time.perf_counter() - started < program_cache._START_WAIT_S


def test_a_weight_written_while_its_program_compiles_is_pinned_not_served_stale(monkeypatch):
    model = _mlp()
    eager = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], background=True, replay=False)
    clear_caches()
    gate = _gated_builds(monkeypatch)
    x = torch.randn(4, 16)
    with torch.no_grad():
        for _ in range(2):
            assert_same(model(x), eager(x), **ORT)
        for m in (model, eager):  # an optimizer step while the program that baked the weight compiles
            m[0].weight.mul_(0.5)
        gate.set()
        torchnative.wait_for_compiles()
        for _ in range(4):  # the program built on the old weight is dropped; the next takes it as an input
            assert_same(model(x), eager(x), **ORT)
            torchnative.wait_for_compiles()
    assert any(t is model[0].weight for t in torchnative.pinned())
    assert any("compiled in the background" in why for why in torchnative.stats()["pinned"].values())
    compiled = _compiled(programs())
    assert compiled and all(ref() is not model[0].weight for p in compiled for _, ref, _ in p.baked)


class _Slots(torch.nn.Module):
    """A static cache's write: each call writes its row at the slot a counter holds, then moves the
    counter on — transformers' StaticCache (`cumulative_length`) in small."""

    def __init__(self):
        super().__init__()
        self.slots, self.at = torch.zeros(4, 8), torch.tensor(0)

    def forward(self, x):
        self.slots.index_copy_(0, self.at.view(1), x)
        self.at.add_(1)
        return self.slots.sum(0) * 2


def test_a_state_written_by_the_calls_after_its_build_started_is_built_on_its_value_at_the_call(monkeypatch):
    """A background build checks its program on the values its inputs had at the call that
    started it, not on what later calls left there: here the counter the next call moved past the
    last slot (the build's check indexed out of range, and the error reached the user's call)."""
    model, eager = _Slots(), _Slots()
    torchnative.accelerate(model, delegates=["ort"], background=True, compile_after=1)
    clear_caches()
    gate = _gated_builds(monkeypatch)
    with torch.no_grad():
        for i in range(5):
            x = torch.randn(1, 8, generator=torch.Generator().manual_seed(i))
            for m in (model, eager):  # the harness puts the counter back at the last slot: it ends at 4
                m.at.fill_(3)
            assert_same(model(x), eager(x), **ORT)
            assert_same(model.slots, eager.slots, **ORT)
            if i == 1:  # the build started at the first call; it runs once the counter is at 4
                gate.set()
                torchnative.wait_for_compiles()
    assert _compiled(programs()) and not torchnative.stats()["fallbacks"]


def test_adaptation_steps_match_eager_with_background_compiles():
    tent = METHODS[0]
    model = _resnet()
    eager = tent.setup(copy.deepcopy(model))
    accelerated = tent.setup(torchnative.accelerate(copy.deepcopy(model), delegates=["ort"], background=True))
    clear_caches()
    for i in range(12):
        if i == 6:
            torchnative.wait_for_compiles()  # the second half runs the compiled programs
        x = _images(i)
        assert_same(tent.step(accelerated, x, i), tent.step(eager, x, i), **ORT)
    assert_same(dict(accelerated[0].state_dict()), dict(eager[0].state_dict()), **ORT)
    assert _compiled(programs())


def test_a_process_exits_while_a_program_compiles():
    script = """
import torch, torchnative
m = torchnative.accelerate(torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()), delegates=["ort"], background=True)
x = torch.randn(2, 64)
with torch.no_grad():
    for _ in range(3):
        y = m(x)
print(bool(torch.isfinite(y).all()))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().endswith("True")


def test_a_weight_given_other_memory_while_its_program_builds_is_not_read_freed():
    """A mean teacher's EMA step (`t_p.data = a * t_p.data + ...`) gives a weight other memory
    while its program builds in the background: the build reads the memory it was given, held
    until it ends (it read freed memory: a segfault), and the program, which baked the old values,
    is never run with the new weight. In a child process, so the old code's crash fails the test."""
    script = """
import gc, threading, torch, torchnative
from torchnative.cache import program_cache
import ctypes, numpy
started, go, real, read = threading.Event(), threading.Event(), program_cache.build_program, []
def held_back(graph, delegates, inputs, *args, **kwargs):
    if threading.current_thread() is not threading.main_thread():  # the background build, not eager's
        # as a kernel in flight holds it: the weight's memory by address, no reference to it
        w = next(t for t in inputs if tuple(t.shape) == (2048, 2048))
        memory = numpy.ctypeslib.as_array(ctypes.cast(w.data_ptr(), ctypes.POINTER(ctypes.c_float)), (2048 * 2048,))
        before = float(memory.sum(dtype=numpy.float64))
        started.set()
        go.wait(60)
        read.append(float(memory.sum(dtype=numpy.float64)) == before)
    return real(graph, delegates, inputs, *args, **kwargs)
program_cache.build_program = held_back
model = torch.nn.Linear(2048, 2048)  # 16 MB: freed, its pages go back to the system
accel = torchnative.accelerate(model, delegates=["ort"], compile_after=1, background=True)
x = torch.randn(4, 2048)
with torch.no_grad():
    accel(x)
    assert started.wait(60), "no background build"
    model.weight.data = 0.5 * model.weight.data + 1.0
    gc.collect()
    go.set()
    torchnative.wait_for_compiles()
    for _ in range(3):
        got = accel(x)
    want = torch.nn.functional.linear(x, model.weight, model.bias)
print(read == [True], bool(torch.allclose(got, want, atol=1e-5)))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"exit {done.returncode}: {done.stderr[-2000:]}"
    assert done.stdout.strip().endswith("True True")


def test_sizes_that_vary_compile_their_template_in_the_background():
    """A template compiles in the background like any graph (cache/templates.py): meanwhile each
    size runs its own graph on eager."""
    from tests.test_sizes import Positional, _inputs

    model = Positional()
    expected = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], background=True)
    clear_caches()
    torchnative.reset_stats()
    with torch.no_grad():
        for n in (5, 9, 5, 9, 13, 40, 13):
            assert_same(model(*_inputs(n)), expected(*_inputs(n)))
        torchnative.wait_for_compiles()
        for n in (7, 40):
            assert_same(model(*_inputs(n)), expected(*_inputs(n)))
    assert torchnative.stats()["symbolic_graphs"] == 1 and not torchnative.stats()["fallbacks"]
    assert any(sizes.is_symbolic(p.graph.gm) for p in _compiled(programs()))


def test_the_compile_thread_runs_its_ops_on_one_torch_thread():
    """Its tracing's ops run on one torch thread, the runtimes it loads get the caller's thread
    count; the caller keeps its team until the compile starts (once the caller is idle), then
    runs its calls on one thread while the compile runs beside it (two OpenMP teams on two cores
    wait at each barrier for a thread the other holds), and gets its count back once no compile
    runs, at its next call (or wait_for_compiles)."""

    def inside():
        return torch.get_num_threads(), threads.for_programs()

    callers = torch.get_num_threads()
    assert callers > 1, "the machine runs torch on one thread: nothing to check"
    job = background(True)(inside)
    assert torch.get_num_threads() == callers  # not started: it waits for the caller to be idle
    assert job.result(timeout=60) == (1, callers)
    started, release = threading.Event(), threading.Event()
    held = background(True)(lambda: started.set() or release.wait(60))
    assert started.wait(60)
    model, x = torchnative.accelerate(torch.nn.Linear(4, 4)), torch.randn(2, 4)
    model(x)  # a call while a compile runs
    assert torch.get_num_threads() == 1 and threads.for_programs() == callers
    release.set()
    held.result(timeout=60)
    torchnative.wait_for_compiles()
    assert torch.get_num_threads() == callers and threads.for_programs() == callers
    background(True)(inside).result(timeout=60)
    model(x)  # a call after the compile finished
    assert torch.get_num_threads() == callers


def test_a_torch_compiled_function_runs_while_the_compile_thread_traces():
    """fx's tracing flag is process-wide: a compile's make_fx on the background thread made a user's
    torch.compile'd function, called meanwhile, raise "Detected that you are using FX to
    symbolically trace a dynamo-optimized function"."""
    from torch.fx.experimental.proxy_tensor import make_fx

    tracing, done = threading.Event(), threading.Event()

    def traced(x):
        tracing.set()
        done.wait(60)
        return x + 1

    compiled = torch.compile(lambda x: x * 2, backend="eager")
    job = background(True)(lambda: make_fx(traced)(torch.randn(2)))
    try:
        assert tracing.wait(60)
        assert torch.equal(compiled(torch.ones(2)), torch.full((2,), 2.0))
    finally:
        done.set()
    job.result(timeout=60)
    torchnative.wait_for_compiles()
    assert torch._dynamo.config.error_on_nested_fx_trace  # as it was, once no compile runs


def test_traces_on_two_compile_threads_never_meet():
    """An in-call compile (the compile thread) beside a background one: torch.export keeps state per
    process, and two traces at once failed each other ("Trying to pop empty mode stack"), which a
    probing delegate then kept as its verdict on the op. They take turns."""
    from torchnative.delegates.base import in_clean_thread

    def export(k: int):
        m = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(k)])
        return torch.export.export(m, (torch.randn(2, 8),), strict=False)

    jobs = [program_cache._background.submit(in_clean_thread, export, 6) for _ in range(6)]
    mine = [in_clean_thread(export, 6) for _ in range(6)]
    assert all(len(list(ep.graph.nodes)) > 6 for ep in [*mine, *(j.result(60) for j in jobs)])


def test_model_code_beside_an_export_is_not_told_it_is_exporting():
    """torch.export's `is_exporting()` flag is process-wide: transformers' mask code that ran on the
    user's thread while a background compile exported took export's paths — graphs its calls
    make at no other time. It is true only on the thread that exports."""
    from torchnative.delegates.base import in_clean_thread

    exporting, seen = threading.Event(), {}

    class Probe(torch.nn.Module):
        def forward(self, x):
            seen["compile thread"] = torch.compiler.is_exporting()
            exporting.set()
            release.wait(30)
            return x + 1

    release = threading.Event()
    job = program_cache._background.submit(
        in_clean_thread, lambda: torch.export.export(Probe(), (torch.randn(2),), strict=False))
    try:
        assert exporting.wait(30)
        assert torch.compiler._is_exporting_flag  # what torch set, for the whole process
        seen["user thread"] = torch.compiler.is_exporting()
    finally:
        release.set()
    job.result(60)
    assert seen == {"compile thread": True, "user thread": False}, seen


def _compile_spy(monkeypatch, tmp_path, then=None):
    """ONNX Runtime's compile, writing the pid of the process it runs in to a file first (a child
    process's memory is not this one's); `then(pid)` runs after, inside the compile."""
    from torchnative.delegates import REGISTRY
    ort, compile_ = REGISTRY["ort"], type(REGISTRY["ort"]).compile
    seen = tmp_path / "pids"

    def spied(self, graph):
        with open(seen, "a") as f:
            f.write(f"{os.getpid()}\n")
        if then is not None:
            then()
        return compile_(self, graph)
    monkeypatch.setattr(type(ort), "compile", spied)
    return lambda: [int(p) for p in seen.read_text().split()] if seen.exists() else []


def _background_run(model, n=6):
    eager = copy.deepcopy(model)
    torchnative.accelerate(model, delegates=["ort"], background=True, compile_after=2)
    clear_caches()
    xs = [torch.randn(4, 16, generator=torch.Generator().manual_seed(i)) for i in range(n)]
    with torch.no_grad():
        for x in xs:
            assert_same(model(x), eager(x), **ORT)
            torchnative.wait_for_compiles()


def test_a_background_compile_runs_in_a_child_process(monkeypatch, tmp_path):
    pids = _compile_spy(monkeypatch, tmp_path)
    torchnative.reset_stats()
    _background_run(_mlp())
    assert pids() and os.getpid() not in pids(), pids()
    assert _compiled(programs()) and torchnative.stats()["replays"] >= 1


def test_compiles_in_the_call_and_with_the_child_process_off_run_here(monkeypatch, tmp_path):
    pids = _compile_spy(monkeypatch, tmp_path)
    model, eager = _mlp(), _mlp()
    torchnative.accelerate(model, delegates=["ort"], background=False, compile_after=1)
    with torch.no_grad():
        x = torch.randn(4, 16)
        assert_same(model(x), eager(x), **ORT)
    monkeypatch.setattr(apart, "ENABLED", False)
    _background_run(_mlp())
    assert pids() and set(pids()) == {os.getpid()}, pids()


@pytest.mark.parametrize("how", ["raises", "crashes"])
def test_a_compile_that_fails_in_the_child_leaves_the_partition_on_eager(monkeypatch, tmp_path, how):
    def fail():
        if how == "raises":
            raise ValueError("no translation for this op")
        os.kill(os.getpid(), signal.SIGKILL)  # a converter's native abort
    _compile_spy(monkeypatch, tmp_path, then=fail)
    torchnative.reset_stats()
    _background_run(_mlp())  # outputs eager's in every call
    reasons = " ".join(torchnative.stats()["fallbacks"])
    assert not _compiled(programs())
    assert ("ValueError: no translation for this op" if how == "raises" else "killed by SIGKILL") in reasons, reasons


def _calls(x: torch.Tensor, n: int = 200) -> float:
    """Seconds for n calls of 20 small ops, each call announced as an accelerated call is."""
    started = time.perf_counter()
    for _ in range(n):
        program_cache.settle_threads()
        for _ in range(20):
            x = x.add(1.0)
    return time.perf_counter() - started


def _beside_python(x: torch.Tensor) -> tuple[float, int]:
    """`_calls`' seconds while the compile thread runs Python, and how much Python it ran meanwhile."""
    stop, started = threading.Event(), threading.Event()
    ran = [0]

    def python():
        started.set()
        while not stop.is_set():
            sum(i * i for i in range(100))
            ran[0] += 1
    job = program_cache._switch.submit(python)
    try:
        started.wait(10)
        ran[0] = 0
        return _calls(x), ran[0]
    finally:
        stop.set()
        job.result(timeout=60)
        program_cache.settle_threads()


def test_the_compile_threads_python_leaves_the_callers_ops_most_of_their_speed(monkeypatch):
    """Each op gives up the GIL around its kernel and needs it back; a compile thread running
    Python (AOTAutograd tracing a backward) kept it until the switch interval ran out, every op
    (an RT-DETR ActMAD step: 0.3-1.7 s instead of 60 ms, for 20 s). While calls come, its Python
    runs in slices with rests: the calls keep most of their speed, and the compile's Python runs
    a fraction of the time it runs without the rests."""
    x = torch.randn(32, 32)
    alone = min(_calls(x) for _ in range(3))
    sliced, sliced_ran = _beside_python(x)
    monkeypatch.setattr(program_cache, "_REST_S", 0.0)
    unsliced, unsliced_ran = _beside_python(x)
    assert sliced < 2.5 * alone, (alone, sliced, unsliced)
    assert sliced_ran / sliced < 0.5 * unsliced_ran / unsliced, (sliced_ran, sliced, unsliced_ran, unsliced)


def test_a_compile_process_is_not_forked_while_another_thread_imports(tmp_path, monkeypatch):
    """A fork while another thread runs a module's import left the child that module half run and
    its lock held by a thread it does not have: the child's import of it waited forever. The fork
    waits for the import to finish."""
    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.0)\nVALUE = 7\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    importing = threading.Thread(target=lambda: __import__("slow_to_import"))
    importing.start()
    time.sleep(0.2)  # the import is under way

    def compile_():
        import slow_to_import
        return Artifact("eager", bytes([slow_to_import.VALUE]))

    try:
        assert _compiled_apart(compile_).payload == bytes([7])
    finally:
        importing.join()


def _compiled_apart(compile_) -> Artifact:
    """`compile_` run by a background build's child process, waited for a minute at most."""
    from concurrent.futures import ThreadPoolExecutor

    pool = ThreadPoolExecutor(1)
    try:
        return pool.submit(apart.compiled, compile_, {}).result(timeout=60)
    finally:
        for pid in list(apart._children):  # a child stuck on a lock: ended, so the thread ends too
            os.kill(pid, signal.SIGKILL)
        pool.shutdown(wait=False)


def test_a_compile_process_forked_while_a_thread_holds_tqdm_s_lock_does_not_wait_for_it():
    """torch.export's fx interpreter makes a tqdm progress bar, whose class lock tqdm's monitor
    thread takes every few seconds: a child forked while a thread held it waited for it until the
    timeout (30 min), and a caller waiting for that build with it (found hung in the default run)."""
    from tqdm import tqdm

    def compile_():
        with tqdm(total=1, disable=True):
            return Artifact("eager", b"done")

    held, release = threading.Event(), threading.Event()

    def hold():
        with tqdm.get_lock():
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    held.wait()
    try:
        assert _compiled_apart(compile_).payload == b"done"
    finally:
        release.set()
        holder.join()


def test_an_in_call_build_runs_torch_on_one_thread_and_its_programs_on_the_callers():
    """The compile thread's own torch ops run on one thread: a thread that ran one on two keeps an
    OpenMP team, and libgomp then throttles every team's spin (more threads than cores), so every
    eager op of the process after the first in-call build ran slower (an ActMAD step on RT-DETR
    36 -> 72 ms). The programs it loads take the caller's count."""
    import onnxruntime as ort

    from torchnative.delegates import base

    clear_caches()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
    accelerated = torchnative.accelerate(copy.deepcopy(model), delegates=["ort"], compile_after=2, background=False)
    x = torch.randn(256, 64)
    with torch.no_grad():
        for _ in range(3):
            assert_same(accelerated(x), model(x), rtol=1e-4, atol=1e-5)
    assert base._compiler.submit(torch.get_num_threads).result() == 1
    sessions = [c.cell_contents.__self__ for p in programs() for s in p.steps if getattr(s.run, "__closure__", None)
                for c in s.run.__closure__ if isinstance(getattr(c.cell_contents, "__self__", None), ort.InferenceSession)]
    sessions += [c.cell_contents for p in programs() for s in p.steps for c in (getattr(s.run, "__closure__", None) or ())
                 if isinstance(c.cell_contents, ort.InferenceSession)]
    assert sessions, [s.run for p in programs() for s in p.steps]
    assert {s.get_session_options().intra_op_num_threads for s in sessions} == {torch.get_num_threads()}

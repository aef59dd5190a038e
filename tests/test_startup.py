"""Startup: the command line and `import torchnative` print only torchnative's own output, and
`torchnative delegates` answers from package metadata and the drivers, not by importing every
toolchain (executorch alone takes seconds, and prints torchao's notes)."""
from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import torchnative
from torchnative.delegates import REGISTRY

# what availability() must not import: compilers and converters the answer does not need
# (onnxruntime is imported: whether the QNN execution provider registers is the answer)
_TOOLCHAINS = ("executorch", "torchao", "coremltools", "onnx", "onnxscript", "ml_dtypes", "iree.runtime",
               "iree.compiler", "transformers")


def _python(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    done = subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=300)
    return done, time.perf_counter() - start


def _cli(*args: str) -> tuple[subprocess.CompletedProcess, float]:
    return _python("-m", "torchnative.cli", *args)


def test_delegates_prints_its_table_alone():
    done, _ = _cli("delegates")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    rows = [line.split(None, 2) for line in done.stdout.splitlines()]
    assert [r[0] for r in rows] == list(REGISTRY), done.stdout
    statuses = {name: a.status for name, a in torchnative.availability().items()}
    assert {r[0]: r[1] for r in rows} == statuses


def test_delegates_takes_little_more_than_importing_torch():
    # best of two of each, interleaved: other processes share this machine's cores
    torch_times, delegates_times = [], []
    for _ in range(2):
        done, t = _python("-c", "import torch")
        assert done.returncode == 0, done.stderr
        torch_times.append(t)
        done, t = _cli("delegates")
        assert done.returncode == 0, done.stderr
        delegates_times.append(t)
    # measured here: 1.2-1.4 (torchnative's own import, then ~0.2 s of checks). Importing
    # iree.runtime (and with it ml_dtypes, 1.8 s) to list IREE's devices made it 1.6-1.7 on a busy
    # machine, too close to tell apart reliably: test_availability_imports_no_toolchain does that
    ratio = min(delegates_times) / min(torch_times)
    assert ratio <= 2, f"`torchnative delegates` took {min(delegates_times):.1f} s, `import torch` {min(torch_times):.1f} s"


def test_availability_imports_no_toolchain():
    done, _ = _python("-c", "import sys, torchnative; torchnative.availability(); print(sorted(m for m in sys.modules "
                            "if any(m == t or m.startswith(t + '.') for t in sys.argv[1:])))", *_TOOLCHAINS)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]", f"availability() imported {done.stdout.strip()}"


def test_import_prints_nothing():
    done, _ = _python("-c", "import torchnative")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


def test_help_prints_nothing_on_stderr():
    done, _ = _cli("--help")
    assert done.returncode == 0, done.stderr
    assert done.stderr == ""
    assert done.stdout.startswith("Usage: torchnative")


@pytest.mark.skipif(REGISTRY["xnnpack"].available().status != "executes", reason="executorch is not installed")
def test_importing_executorch_prints_nothing():
    # the first xnnpack node asked about imports executorch, and with it torchao
    done, _ = _python("-c", "import logging; from torchnative import quiet; from torchnative.delegates import xnnpack; xnnpack._targets(); "
                            "print([logging.getLogger(n).filters for n in quiet._IMPORT_NOTES])")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("[[], []]\n", "")


_ACCELERATE = ("m = torchnative.accelerate(torch.nn.Linear(4, 4), delegates=['ort'])\n"
               "with torch.no_grad():\n    [m(torch.randn(2, 4)) for _ in range(3)]\n"
               "import os; print(os.environ.get('GOMP_SPINCOUNT'))")


def _spin(code: str, **settings: str) -> subprocess.CompletedProcess:
    """`code` in a new process whose environment sets only these of OpenMP's spin settings."""
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], capture_output=True, text=True, timeout=300,
                          env={**env, **settings})
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_imported_before_torch_it_shortens_the_openmp_spin():
    """torch's OpenMP threads spin on the cores delegate programs run on (torchnative/threads.py)."""
    done = _spin("import torchnative, torch\n" + _ACCELERATE)
    assert done.stdout.split() == ["10000"] and "GOMP_SPINCOUNT" not in done.stderr


def test_imported_after_torch_it_says_once_how_to_shorten_the_spin():
    done = _spin("import torch, torchnative\n" + _ACCELERATE + "\n" + _ACCELERATE)
    assert done.stderr.count("set GOMP_SPINCOUNT=10000") == 1


@pytest.mark.parametrize("setting", [{"GOMP_SPINCOUNT": "5"}, {"OMP_WAIT_POLICY": "PASSIVE"}])
def test_a_spin_the_user_set_is_left_alone(setting):
    done = _spin("import torchnative, torch\n" + _ACCELERATE, **setting)
    assert done.stdout.split() == [setting.get("GOMP_SPINCOUNT", "None")] and "GOMP_SPINCOUNT" not in done.stderr

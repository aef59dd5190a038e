"""Startup: the command line and `import torchnative` print only torchnative's own output, and
`torchnative delegates` answers from package metadata and the drivers, not by importing every
toolchain (executorch alone takes seconds, and prints torchao's notes)."""
from __future__ import annotations

import os
import re
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
    done, _ = _python("-c", "from torchnative.delegates import xnnpack; xnnpack._targets()")
    assert done.returncode == 0, done.stderr
    assert (done.stdout, done.stderr) == ("", "")


# a model's config whose token ids are in its vocabulary: transformers rightly warns of one that is not
_MODEL = ("import transformers as T\n"
          "m = T.GPT2LMHeadModel(T.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, bos_token_id=0, "
          "eos_token_id=0)).eval()\n")
_FIRST_CALLS = ("a = torchnative.accelerate(m, delegates=[{!r}], background=False, compile_after=1)\n"
                "x = torch.randint(0, 100, (1, 8))\n"
                "with torch.no_grad():\n    [a(x) for _ in range(3)]\n"
                "assert torchnative.stats()['graphs_built'] > 0\n")


def _executes(name: str):
    return pytest.mark.skipif(REGISTRY[name].available().status != "executes", reason=f"{name} does not execute here")


# each path a user takes, in a fresh process: only the user's and torchnative's output
_PATHS = {
    "transformers first, then torchnative": "import transformers, torchnative, torch\n" + _MODEL,
    # torchnative first, then a transformers model, then its first calls
    "first accelerate calls on ort": "import torchnative, torch\n" + _MODEL + _FIRST_CALLS.format("ort"),
    "first accelerate calls on xnnpack": pytest.param("import torchnative, torch\n" + _MODEL
                                                      + _FIRST_CALLS.format("xnnpack"),
                                                      marks=[_executes("xnnpack"), pytest.mark.slow]),
    "first accelerate calls on qnn": pytest.param("import torchnative, torch\n" + _MODEL + _FIRST_CALLS.format("qnn"),
                                                  marks=[_executes("qnn"), pytest.mark.slow]),
    "first accelerate calls on coreml": pytest.param("import torchnative, torch\n" + _MODEL
                                                     + _FIRST_CALLS.format("coreml").replace("assert", "# compile-only:"),
                                                     marks=pytest.mark.slow),
}


@pytest.mark.parametrize("code", list(_PATHS.values()), ids=list(_PATHS))
def test_a_users_path_prints_no_dependency_notes(code, tmp_path):
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                          env={**os.environ, "TORCHNATIVE_CACHE_DIR": str(tmp_path)})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stderr == ""


def test_the_cli_prints_only_its_own_progress_and_tables(tmp_path):
    env = {**os.environ, "TORCHNATIVE_CACHE_DIR": str(tmp_path / "cache"), "COLUMNS": "80"}
    bundle = tmp_path / "gpt2.bundle"
    made = subprocess.run([sys.executable, "-m", "torchnative.cli", "capture-and-compile", "--out", str(bundle)],
                          capture_output=True, text=True, timeout=600, env=env)
    assert made.returncode == 0, made.stderr[-3000:]
    # stderr: the progress, one line per task
    tasks = re.compile(r"\s*(building|capturing|compiling graph \d+:|saving|loading the bundle back) ")
    assert all(tasks.match(line) for line in made.stderr.splitlines() if line.strip()), made.stderr
    ran = subprocess.run([sys.executable, "-m", "torchnative.cli", "run", str(bundle), "--generate", "4"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]
    said = ran.stderr.splitlines()  # the tokens go to stdout; what they are and how fast, to stderr
    assert said[0] == "input_ids: a random prompt of 16 tokens" and len(said) == 2, ran.stderr
    assert said[1].startswith("4 new tokens after a 16-token prompt"), ran.stderr
    shown = subprocess.run([sys.executable, "-m", "torchnative.cli", "inspect", str(bundle)],
                           capture_output=True, text=True, timeout=600, env=env)
    assert shown.returncode == 0 and shown.stderr == "", shown.stderr[-3000:]
    # the tables fit 80 columns (a path, the user's, may not), and the summary's title is whole
    for out in (made.stdout, shown.stdout):
        assert max(len(line) for line in out.splitlines() if str(tmp_path) not in line) <= 80, out
    assert re.search(r"^graphs per method: prefill \d+, decode \d+; [\d.]+ s$", made.stdout, re.M), made.stdout


def test_what_is_not_noise_still_reaches_the_user():
    """A compile (in quiet()) runs on a thread beside the user's code: only its own notes are dropped."""
    code = """
import logging, sys, threading, warnings
import torchnative
from torchnative.quiet import quiet
inside, finish = threading.Event(), threading.Event()
def compile_like():
    with quiet():
        warnings.warn("toolchain warning")
        logging.getLogger("toolchain").warning("toolchain record")
        print("toolchain bar", file=sys.stderr)
        inside.set()
        finish.wait()
t = threading.Thread(target=compile_like)
t.start()
inside.wait()
warnings.warn("user warning")
logging.getLogger("user").warning("user record")
print("user line", file=sys.stderr)
logging.getLogger("torchao").warning("torchao: a real problem")
finish.set()
t.join()
warnings.warn("user warning after")
logging.getLogger("toolchain").warning("toolchain record outside quiet()")
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    for kept in ("user warning", "user record", "user line", "torchao: a real problem", "user warning after",
                 "toolchain record outside quiet()"):
        assert kept in done.stderr, (kept, done.stderr)
    assert "toolchain warning" not in done.stderr and "toolchain bar" not in done.stderr
    assert "toolchain record\n" not in done.stderr


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

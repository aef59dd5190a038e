"""OpInfo samples under capture vs eager. The sweep runs in a child process so that a crash is
a reported failure. Default: the first 2 samples of every float32 op; `-m slow`: all samples.
Both check the capture itself, so graphs run on the eager delegate (the delegates' claims have
their own sweep in test_delegates)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest

SWEEP = Path(__file__).with_name("opinfo_sweep.py")


def _sweep(tmp_path, *extra):
    out = tmp_path / "opinfo.json"
    proc = subprocess.run([sys.executable, str(SWEEP), "--out", str(out), "--delegates", "eager", *extra],
                          capture_output=True, text=True, timeout=3000)
    assert proc.returncode == 0, f"sweep process died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())


def _check(r):
    ran = r["pass"] + r["fail"]
    assert ran > 500
    assert r["pass_rate"] >= 0.95, "\n".join(r["failures"][:50])


def test_opinfo_subset_matches_eager(tmp_path):
    _check(_sweep(tmp_path, "--samples", "2"))


@pytest.mark.slow
def test_opinfo_full_sweep_matches_eager(tmp_path):
    _check(_sweep(tmp_path))

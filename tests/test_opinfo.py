"""OpInfo samples under capture vs eager. The sweep runs in a child process so that a crash is
a reported failure. Default: the first 2 samples of every float32 op; `-m slow`: all samples.
Both check the capture itself, so graphs run on the eager delegate (the delegates' claims have
their own sweep in test_delegates)."""
import pytest

from tests.sweep import sweep


def _sweep(tmp_path, *extra):
    return sweep(tmp_path, "--delegates", "eager", *extra, timeout=3000)


def _check(r):
    ran = r["pass"] + r["fail"]
    assert ran > 500
    assert r["pass_rate"] >= 0.95, "\n".join(r["failures"][:50])


def test_opinfo_subset_matches_eager(tmp_path):
    _check(_sweep(tmp_path, "--samples", "2"))


@pytest.mark.slow
def test_opinfo_full_sweep_matches_eager(tmp_path):
    _check(_sweep(tmp_path))

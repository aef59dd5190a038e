"""The OpInfo sweep (`opinfo_sweep.py`) in a child process, so that a crash is a reported failure."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

SWEEP = Path(__file__).with_name("opinfo_sweep.py")


def sweep(tmp_path: Path, *args: str, cache: Path | None = None, timeout: int = 1800) -> dict:
    """The sweep's results (JSON) for `args`; `cache`: its TORCHNATIVE_CACHE_DIR."""
    out = tmp_path / "sweep.json"
    env = {**os.environ, "TORCHNATIVE_CACHE_DIR": str(cache)} if cache is not None else None
    proc = subprocess.run([sys.executable, str(SWEEP), *args, "--out", str(out)], capture_output=True, text=True,
                          timeout=timeout, env=env)
    assert proc.returncode == 0, f"sweep process died (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
    return json.loads(out.read_text())

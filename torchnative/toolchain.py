"""The versions an artifact depends on: torchnative (with a hash of its code), torch and the
packages a delegate names in `Delegate.toolchain`. Disk cache keys and bundle manifests carry them."""
from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import json
from pathlib import Path
from typing import Iterable


@functools.cache
def _source_hash() -> str:
    """torchnative's own code: a changed delegate or pass makes every cached artifact stale, even
    in a development tree whose version number has not moved."""
    h = hashlib.sha256()
    for path in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(path.read_bytes())
    return h.hexdigest()[:12]


def versions(packages: Iterable[str]) -> dict[str, str]:
    """Installed versions of torchnative, torch and `packages`."""
    names = {"torch", *packages}
    found = {"torchnative": f"{importlib.metadata.version('torchnative')}+{_source_hash()}"}
    for name in sorted(names):
        try:
            found[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            found[name] = "not installed"
    return found


@functools.cache
def fingerprint(packages: tuple[str, ...]) -> str:
    """`versions(packages)` as one string, for keys."""
    return json.dumps(versions(packages), sort_keys=True)

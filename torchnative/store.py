"""The directory that keeps what one process computed for the next (DESIGN.md §6): compiled
partitions and partitionings (`build.disk_cache`) and the small answer tables of the probes that
find which ops a compiler takes (`delegates.probe`). Files are written beside and renamed into
place, so two processes sharing the directory see a whole file or none; a file that cannot be
read back is removed, to be rebuilt, never trusted."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path

from torchnative import events

_dir: Path | None | bool = True  # True: not chosen yet (environment or XDG default); None: off


def default_dir() -> Path | None:
    """$TORCHNATIVE_CACHE_DIR ("off" disables), else $XDG_CACHE_HOME/torchnative, else ~/.cache/torchnative."""
    chosen = os.environ.get("TORCHNATIVE_CACHE_DIR")
    if chosen is not None:
        return None if chosen in ("", "off", "0") else Path(chosen)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchnative"


def directory() -> Path | None:
    global _dir
    if _dir is True:
        _dir = default_dir()
    return _dir


def set_directory(path: str | os.PathLike | None) -> None:
    """Where compiled partitions are kept across processes; None turns the disk cache off."""
    global _dir
    _dir = Path(path) if path is not None else None


def count(what: str) -> None:
    events.STATS.disk_cache[what] += 1


def discard(name: str) -> None:
    """A corrupt file (or one whose artifact failed to load): removed, to be rebuilt."""
    count("corrupt")
    folder = directory()
    if folder is not None:
        (folder / name).unlink(missing_ok=True)


def write(name: str, data: bytes) -> None:
    """Whole or not at all: written beside, then renamed over (atomic on POSIX)."""
    folder = directory()
    if folder is None:
        return
    tmp = None
    try:
        folder.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=f".{name[:16]}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, folder / name)
        count("writes")
    except OSError as e:  # a full or read-only disk costs the next process a compile, nothing more
        count(f"write failed: {type(e).__name__}")
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)


_tables: dict[str, dict] = {}


def table(name: str, fingerprint: str) -> dict:
    """A small JSON table kept across processes (a delegate's answers about which ops it takes),
    valid while `fingerprint` (its toolchain's versions) holds."""
    if name not in _tables:
        _tables[name] = {}
        folder = directory()
        path = folder / _table_file(name, fingerprint) if folder is not None else None
        if path is not None and path.exists():
            try:
                _tables[name] = json.loads(path.read_text())
            except (OSError, ValueError):
                discard(path.name)
    return _tables[name]


def remember(name: str, fingerprint: str, key: str, value) -> None:
    table(name, fingerprint)[key] = value
    write(_table_file(name, fingerprint), json.dumps(_tables[name]).encode())


def _table_file(name: str, fingerprint: str) -> str:
    return f"{name}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.json"

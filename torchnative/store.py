"""The place that keeps what one process computed for the next (DESIGN.md §6): compiled
partitions and partitionings (`build.disk_cache`) and the small answer tables of the probes that
find which ops a compiler takes (`delegates.probe`). A local directory, or an fsspec URL
(`s3://bucket/prefix`: remote.py) that workers and machines share.

Every object is framed: a JSON header line with the payload's size and sha256 (and what the
caller adds), then the payload. A reader sees a whole object or none (a local file is written
beside and renamed over; a remote one is written beside, checked, then moved into place), and an
object whose frame, size or hash is wrong — corrupt, cut short, or not ours — is removed, to be
rebuilt, never trusted."""
from __future__ import annotations

import hashlib
import json
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from torchnative import events, remote

_place: Any = True  # True: not chosen yet (environment or XDG default); None: off


class _Directory:
    def __init__(self, root: Path):
        self.root = root

    def get(self, name: str) -> bytes | None:
        try:
            return (self.root / name).read_bytes()
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes) -> None:
        """Written beside, then renamed over (atomic on POSIX)."""
        self.root.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=self.root, prefix=f".{name[:16]}.", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, self.root / name)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise

    def remove(self, name: str) -> None:
        (self.root / name).unlink(missing_ok=True)


class _Bucket:
    """An fsspec URL's objects (remote.py)."""

    def __init__(self, url: str):
        self.fs, self.root = remote.filesystem(url)

    def get(self, name: str) -> bytes | None:
        try:
            return self.fs.cat_file(f"{self.root}/{name}")
        except FileNotFoundError:
            return None

    def put(self, name: str, data: bytes) -> None:
        remote.publish(self.fs, f"{self.root}/{name}", data)

    def remove(self, name: str) -> None:
        try:
            self.fs.rm_file(f"{self.root}/{name}")
        except FileNotFoundError:
            pass


def _open(path: str | os.PathLike) -> _Directory | _Bucket:
    return _Bucket(path) if remote.is_url(path) else _Directory(Path(path))


def default_place() -> str | None:
    """$TORCHNATIVE_CACHE_DIR (a path or URL; "off" disables), else $XDG_CACHE_HOME/torchnative,
    else ~/.cache/torchnative."""
    chosen = os.environ.get("TORCHNATIVE_CACHE_DIR")
    if chosen is not None:
        return None if chosen in ("", "off", "0") else chosen
    return str(Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "torchnative")


def place() -> _Directory | _Bucket | None:
    """Where the cache is (None: off)."""
    global _place
    if _place is True:
        chosen = default_place()
        _place = _open(chosen) if chosen is not None else None
    return _place


def set_place(path: str | os.PathLike | None) -> None:
    """Where compiled partitions are kept across processes (a directory or an fsspec URL); None
    turns the cache off."""
    global _place
    _place = _open(path) if path is not None else None


@contextmanager
def placed(path: str | os.PathLike | None) -> Iterator[None]:
    """The cache at `path` inside the block, where it was after (a matrix cell run in the caller's
    process)."""
    global _place
    before = place()
    set_place(path)
    try:
        yield
    finally:
        _place = before


def count(what: str) -> None:
    events.STATS.disk_cache[what] += 1


def read(name: str) -> tuple[dict, bytes] | None:
    """(the header's fields, the payload) of a whole object; None if there is none (or it was
    corrupt: then it is removed and counted)."""
    at = place()
    if at is None:
        return None
    try:
        data = at.get(name)
    except Exception as e:  # an unreachable disk or bucket (botocore's own errors too) costs a compile, nothing more
        count(f"read failed: {type(e).__name__}")
        return None
    if data is None:
        return None
    line, _, payload = data.partition(b"\n")
    try:
        header = json.loads(line)
    except ValueError:
        header = None
    if (not isinstance(header, dict) or header.get("bytes") != len(payload)
            or header.get("sha256") != hashlib.sha256(payload).hexdigest()):
        discard(name)
        return None
    return header, payload


def write(name: str, payload: bytes, **fields: Any) -> None:
    """Whole or not at all; `fields` go into the header (JSON)."""
    at = place()
    if at is None:
        return
    header = json.dumps({**fields, "bytes": len(payload), "sha256": hashlib.sha256(payload).hexdigest()})
    try:
        at.put(name, header.encode() + b"\n" + payload)
        count("writes")
    except Exception as e:  # a full or read-only disk, or a bucket refusing, costs the next process a compile
        count(f"write failed: {type(e).__name__}")


def discard(name: str) -> None:
    """A corrupt object (or one whose artifact failed to load): removed, to be rebuilt."""
    count("corrupt")
    remove(name)


def remove(name: str) -> None:
    at = place()
    if at is not None:
        try:
            at.remove(name)
        except Exception as e:
            count(f"remove failed: {type(e).__name__}")


_tables: dict[str, dict] = {}


def table(name: str, fingerprint: str) -> dict:
    """A small JSON table kept across processes (a delegate's answers about which ops it takes),
    valid while `fingerprint` (its toolchain's versions) holds."""
    if name not in _tables:
        stored = read(_table_file(name, fingerprint))
        try:
            _tables[name] = json.loads(stored[1]) if stored is not None else {}
        except ValueError:
            discard(_table_file(name, fingerprint))
            _tables[name] = {}
    return _tables[name]


def remember(name: str, fingerprint: str, key: str, value) -> None:
    table(name, fingerprint)[key] = value
    write(_table_file(name, fingerprint), json.dumps(_tables[name]).encode())


def _table_file(name: str, fingerprint: str) -> str:
    return f"{name}-{hashlib.sha256(fingerprint.encode()).hexdigest()[:16]}.json"

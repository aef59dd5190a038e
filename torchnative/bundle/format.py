"""What a bundle is on disk (DESIGN.md §7): a directory, or one zip file, holding `manifest.json`,
one file per partition, and the weights as safetensors; either on this machine or at an fsspec URL
(`s3://bucket/models/gpt2.bundle`: remote.py). Readers and writers meet here."""
from __future__ import annotations

import hashlib
import io
import json
import zipfile
from pathlib import Path
from typing import Any, Callable

from torchnative import remote

# 2: methods and states; 3: sizes as expressions in n (a method's `size`: bundle/dynamic.py); 4: a
# method run as buckets of sizes (bundle/buckets.py). Each reads the older ones' manifests as they
# are (it adds to them), and a bundle is written as the oldest schema that holds it.
SCHEMA = 4
SIZED = 3
OLDEST = 2
MANIFEST = "manifest.json"
WEIGHTS = "weights.safetensors"

class BundleError(Exception):
    """A bundle cannot be written, read or run; the message names what is wrong and what to do."""


def sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def write(path: Path | str, files: dict[str, bytes], on_file: Callable[[str, int], None] = lambda name, size: None) -> None:
    """All files, the manifest last: a bundle interrupted while written has none and is refused
    as incomplete, never read half-written. `on_file(name, bytes)` follows each file (progress).
    At a URL: a zip is one object, published whole; a directory's files are objects (each PUT is
    whole), the manifest last."""
    names = [n for n in files if n != MANIFEST] + [MANIFEST]
    if remote.is_url(path):
        fs, root = remote.filesystem(path)
        if root.endswith(".zip"):
            remote.publish(fs, root, _zipped(files, names, on_file))
            return
        if fs.exists(f"{root}/{MANIFEST}"):
            fs.rm_file(f"{root}/{MANIFEST}")
        for n in names:
            fs.pipe_file(f"{root}/{n}", files[n])
            on_file(n, len(files[n]))
        return
    if path.suffix == ".zip":
        tmp = path.with_name(path.name + ".partial")
        tmp.write_bytes(_zipped(files, names, on_file))
        tmp.replace(path)
        return
    path.mkdir(parents=True, exist_ok=True)
    (path / MANIFEST).unlink(missing_ok=True)
    for n in names:
        target = path / n
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(target.name + ".partial")
        tmp.write_bytes(files[n])
        tmp.replace(target)
        on_file(n, len(files[n]))


def _zipped(files: dict[str, bytes], names: list[str], on_file: Callable[[str, int], None]) -> bytes:
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as z:
        for n in names:
            z.writestr(n, files[n])
            on_file(n, len(files[n]))
    return buffer.getvalue()


class Reader:
    """Files of a bundle by name, from a directory or a zip file, here or at a URL."""

    def __init__(self, path: str | Path):
        self.path: Path | str = path if remote.is_url(path) else Path(path)
        self.zip = None
        self.fs = None
        if remote.is_url(path):
            self.fs, self.root = remote.filesystem(path)
            if not self.fs.exists(self.root):
                raise BundleError(f"no bundle at {path}: write one with `torchnative capture-and-compile --out {path}`")
            if self.root.endswith(".zip"):
                self._open_zip(lambda: io.BytesIO(self.fs.cat_file(self.root)))
            return
        if not self.path.exists():
            raise BundleError(f"no bundle at {self.path}: write one with `torchnative capture-and-compile --out {self.path}`")
        if self.path.is_file():
            self._open_zip(lambda: self.path)

    def _open_zip(self, source: Callable[[], Any]) -> None:
        try:
            self.zip = zipfile.ZipFile(source())
        except zipfile.BadZipFile as e:
            raise BundleError(f"{self.path} is neither a bundle directory nor a bundle zip file ({e})") from e

    def has(self, name: str) -> bool:
        if self.zip is not None:
            return name in self.zip.namelist()
        if self.fs is not None:
            return self.fs.isfile(f"{self.root}/{name}")
        return (self.path / name).is_file()

    def read(self, name: str) -> bytes:
        if not self.has(name):
            raise BundleError(f"{self.path} has no {name}: the bundle is incomplete; write it again with "
                              f"`torchnative capture-and-compile`")
        if self.zip is not None:
            try:
                return self.zip.read(name)
            except (zipfile.BadZipFile, OSError) as e:
                raise BundleError(f"{name} in {self.path} cannot be read ({e}): the zip is damaged; "
                                  f"write the bundle again") from e
        if self.fs is not None:
            return self.fs.cat_file(f"{self.root}/{name}")
        return (self.path / name).read_bytes()

    def manifest(self) -> dict:
        try:
            manifest = json.loads(self.read(MANIFEST))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise BundleError(f"{self.path}/{MANIFEST} is not valid JSON ({e}); write the bundle again") from e
        schema = manifest.get("schema") if isinstance(manifest, dict) else None
        if not isinstance(schema, int):
            raise BundleError(f"{self.path}/{MANIFEST} has no schema version: not a torchnative bundle")
        if schema > SCHEMA:
            raise BundleError(f"{self.path} has bundle schema {schema}, newer than this torchnative "
                              f"reads ({SCHEMA}); upgrade torchnative (it was written by "
                              f"torchnative {manifest.get('toolchain', {}).get('torchnative', '?')})")
        if schema < OLDEST:
            raise BundleError(f"{self.path} has bundle schema {schema}, older than this torchnative "
                              f"reads ({OLDEST}..{SCHEMA}); write it again with `torchnative capture-and-compile`")
        return manifest

    def checked(self, name: str, expected: Any) -> bytes:
        """The file's bytes, after checking its size and hash against the manifest's (`expected`:
        its entry, with `bytes` and `sha256`)."""
        data = self.read(name)
        if len(data) != expected.bytes:
            raise BundleError(f"{name} in {self.path} has {len(data)} bytes, the manifest says "
                              f"{expected.bytes}: the file is truncated or replaced; write the bundle again")
        digest = sha256(data)
        if digest != expected.sha256:
            raise BundleError(f"{name} in {self.path} does not match its hash in the manifest "
                              f"(sha256 {digest[:16]}…, expected {expected.sha256[:16]}…): the file was "
                              f"modified or corrupted; write the bundle again")
        return data

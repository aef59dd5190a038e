"""Places off this machine, named by fsspec URLs (`s3://bucket/prefix`, `gs://…`, `memory://…`):
where a shared cache (store.py) or a bundle (bundle/format.py) can live. fsspec and a protocol's
package (s3fs for s3://) are the `.[scale]` extra; a local path never imports them. Credentials and
endpoints are fsspec's and the protocol's own settings (for S3: `AWS_ACCESS_KEY_ID`,
`AWS_ENDPOINT_URL`, … or `FSSPEC_S3_ENDPOINT_URL`), so workers configured like the driver reach
the same bucket."""
from __future__ import annotations

import hashlib
import uuid
from typing import Any


class RemoteError(OSError):
    """A URL cannot be reached or written; the message names the URL and the fix."""


def is_url(path: Any) -> bool:
    return isinstance(path, str) and "://" in path


def filesystem(url: str) -> tuple[Any, str]:
    """(the fsspec filesystem, the path inside it) of `url`."""
    try:
        import fsspec

        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as e:
        raise RemoteError(f"{url}: {e}; install the scale extra: pip install 'torchnative[scale]' "
                          f"(fsspec, s3fs)") from e
    return fs, root.rstrip("/")


def publish(fs: Any, path: str, data: bytes) -> None:
    """Written beside (`.partial/` next to the object), checked (size, and the MD5 an S3 ETag of
    one upload is), then moved into place: a reader sees the whole object or none. Object stores
    have no rename; the move is a server-side copy, which is whole as a single PUT is."""
    folder, _, name = path.rpartition("/")
    partial = f"{folder}/.partial/{name}.{uuid.uuid4().hex}"
    fs.pipe_file(partial, data)
    try:
        info = fs.info(partial)
        etag = str(info.get("ETag", "")).strip('"')
        if info.get("size") != len(data) or (len(etag) == 32 and etag != hashlib.md5(data).hexdigest()):
            raise RemoteError(f"{partial}: {info.get('size')} bytes stored of {len(data)} written "
                              f"(or a different MD5): not published")
        fs.mv(partial, path)
    except BaseException:
        fs.rm_file(partial)
        raise

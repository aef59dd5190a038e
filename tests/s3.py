"""A local S3 server (moto) for the tests of shared caches and bundles at URLs: a fresh bucket per
test, reached through the same settings a user's workers would have (AWS_* variables)."""
from __future__ import annotations

import os
import uuid

import pytest

pytest.importorskip("s3fs", reason="the scale extra (fsspec, s3fs) is not installed")
moto_server = pytest.importorskip("moto.server", reason="moto[server] is not installed")

SETTINGS = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server():
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    saved = {k: os.environ.get(k) for k in (*SETTINGS, "AWS_ENDPOINT_URL")}
    os.environ.update(SETTINGS, AWS_ENDPOINT_URL=f"http://{host}:{port}")
    yield os.environ["AWS_ENDPOINT_URL"]
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v
    server.stop()


@pytest.fixture
def bucket(s3_server):
    """A new empty bucket: (its s3:// URL, the fsspec filesystem)."""
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()  # one bound to an earlier server's endpoint is not reused
    fs = s3fs.S3FileSystem()
    name = f"tn-{uuid.uuid4().hex[:12]}"
    fs.mkdir(name)
    yield f"s3://{name}", fs
    fs.rm(name, recursive=True)

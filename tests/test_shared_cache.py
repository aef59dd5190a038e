"""The cache and bundles at an fsspec URL (torchnative/remote.py, store.py): a bucket on a local S3
server (moto) shared as machines would share one: warm starts from it, whole objects only, a
corrupt or foreign object rebuilt, bundles written to and loaded from it."""
from __future__ import annotations

import pytest
import torch

import torchnative
from tests.s3 import bucket, s3_server  # noqa: F401 (fixtures)
from torchnative import cli, models, remote, store
from torchnative.cache.program_cache import clear_caches


@pytest.fixture
def shared(bucket):  # noqa: F811
    url, fs = bucket
    torchnative.set_cache_dir(f"{url}/cache")
    clear_caches()
    yield f"{url}/cache", fs
    torchnative.set_cache_dir(None)
    clear_caches()


def _bert_run(seed: int = 0) -> dict:
    """A process's start as far as compiled programs go: tiny BERT under capture on ort, checked
    against eager; the cache's counters."""
    clear_caches()
    torchnative.reset_stats()
    model = models.transformers_model("BertModel", "tiny", seed=seed)
    inputs = models.default_inputs(model)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
        with torchnative.capture(["ort"], compile_after=1):
            # the whole output held: what the graph returns is what is alive when it runs, so a
            # dropped output collected early or late would make a graph (and key) of its own
            got = model(**inputs)
    torch.testing.assert_close(got.last_hidden_state, expected, rtol=1e-4, atol=1e-5)
    return dict(torchnative.stats()["disk_cache"])


def _objects(fs, url: str, suffix: str) -> list[str]:
    return [p for p in fs.find(url.removeprefix("s3://")) if p.endswith(suffix)]


def test_a_second_process_starts_warm_from_the_bucket(shared):
    url, fs = shared
    cold = _bert_run()
    assert cold.get("misses", 0) >= 1 and cold.get("writes", 0) >= 2 and "hits" not in cold, cold
    entries = _objects(fs, url, ".entry")
    assert entries and _objects(fs, url, ".plan") and len(_objects(fs, url, ".verdict")) == len(entries)
    assert not [p for p in fs.find(url.removeprefix("s3://")) if "/.partial/" in p]  # nothing half-published left
    warm = _bert_run()
    assert warm.get("hits", 0) == len(entries) and "misses" not in warm and "corrupt" not in warm, warm


# a file cut short fails the same digest check as a flipped byte (~6 s each): under -m slow
@pytest.mark.parametrize("damage", ["flipped byte", pytest.param("cut short", marks=pytest.mark.slow), "foreign object"])
def test_a_damaged_object_in_the_bucket_is_rebuilt_never_trusted(shared, damage):
    url, fs = shared
    _bert_run()
    entries = _objects(fs, url, ".entry")
    for path in entries:
        data = bytearray(fs.cat_file(path))
        if damage == "flipped byte":
            data[-10] ^= 0xFF
        elif damage == "cut short":
            data = data[: len(data) // 2]
        else:  # written by something else under the same name: no frame of ours
            data = bytearray(b"an object some other tool put here")
        fs.pipe_file(path, bytes(data))
    rebuilt = _bert_run()  # results still eager's (checked inside)
    assert rebuilt.get("corrupt") == len(entries) and "hits" not in rebuilt, rebuilt
    assert _bert_run().get("hits") == len(entries)  # whole again


def test_an_object_that_fails_its_check_is_never_published(bucket, monkeypatch):  # noqa: F811
    """Written beside, checked, then moved: a failed check leaves no object and no partial one."""
    url, fs = bucket
    fs_, root = remote.filesystem(f"{url}/x")
    real_info = fs_.info

    def short(path, **kw):  # the store's answer about what it holds, as after a cut-off upload
        info = real_info(path, **kw)
        return {**info, "size": info["size"] - 1} if "/.partial/" in path else info

    monkeypatch.setattr(fs_, "info", short)
    with pytest.raises(remote.RemoteError, match="not published"):
        remote.publish(fs_, f"{root}/obj", b"payload")
    monkeypatch.undo()
    assert fs.find(url.removeprefix("s3://")) == []


def test_an_unreachable_cache_costs_a_compile_not_a_failure(monkeypatch):
    """A cache URL whose server is down: every call still runs (compiled), and the failures are counted."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "x")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    import s3fs

    s3fs.S3FileSystem.clear_instance_cache()
    torchnative.set_cache_dir("s3://nowhere/cache")
    try:
        stats = _bert_run()
    finally:
        torchnative.set_cache_dir(None)
        clear_caches()
    assert any(k.startswith("read failed") for k in stats) and any(k.startswith("write failed") for k in stats), stats


def test_the_local_directory_keeps_working_as_before(tmp_path):
    store.set_place(tmp_path)
    try:
        cold, warm = _bert_run(), _bert_run()
    finally:
        store.set_place(None)
        clear_caches()
    assert "hits" not in cold and warm.get("hits") == len(list(tmp_path.glob("*.entry"))) > 0


@pytest.mark.parametrize("name", ["bert.bundle", "bert.zip"])
def test_a_bundle_written_to_a_bucket_loads_from_it(bucket, name):  # noqa: F811
    url, fs = bucket
    out = f"{url}/models/{name}"
    assert cli.main(["capture-and-compile", "transformers:BertModel", "--no-generate", "--targets", "ort", "--out", out]) == 0
    model = models.transformers_model("BertModel", "tiny")
    inputs = models.default_inputs(model)
    with torch.no_grad():
        expected = model(**inputs).last_hidden_state
    loaded = torchnative.load(out)
    torch.testing.assert_close(loaded(**inputs)["last_hidden_state"], expected, rtol=1e-4, atol=1e-5)
    if name.endswith(".zip"):
        assert _objects(fs, url, ".zip") == [f"{out.removeprefix('s3://')}"]
    else:  # a bundle whose manifest never arrived (an interrupted upload) is refused, not read half-written
        fs.rm_file(f"{out.removeprefix('s3://')}/manifest.json")
        with pytest.raises(torchnative.BundleError, match="incomplete"):
            torchnative.load(out)

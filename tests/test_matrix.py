"""`torchnative compile-matrix` (cli/matrix.py) on a local Ray instance, the bundles and the shared
cache in a bucket of a local S3 server (tests/s3.py): cells complete and their bundles load and
match eager, a second run is served from the cache, a corrupt object is rebuilt, a worker that
dies is retried and said to be."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch

import torchnative
from tests.s3 import bucket, s3_server  # noqa: F401 (fixtures)
from torchnative import cli
from torchnative.cli import matrix as matrix_cli

ray = pytest.importorskip("ray", reason="the scale extra (ray) is not installed")

NETS = '''
import os
from pathlib import Path

import torch


class SmallCNN(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 8, 3)
        self.head = torch.nn.Linear(8 * 14 * 14, 10)

    def forward(self, x):
        return self.head(torch.relu(self.conv(x)).flatten(1))


def small_cnn():
    torch.manual_seed(0)
    return SmallCNN().eval(), {"x": torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(1))}


class MLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = torch.nn.Linear(32, 64), torch.nn.Linear(64, 8)

    def forward(self, x):
        return self.down(torch.nn.functional.gelu(self.up(x)))


def mlp():
    torch.manual_seed(0)
    return MLP().eval(), {"x": torch.randn(4, 32, generator=torch.Generator().manual_seed(1))}


def dies_once():
    """The first worker to build this dies (as one killed or out of memory would); the next builds it."""
    marker = Path(__file__).with_name("died")
    if not marker.exists():
        marker.write_text(str(os.getpid()))
        os._exit(1)
    return mlp()
'''


@pytest.fixture(scope="module")
def local_ray(s3_server):  # noqa: F811 (after the S3 settings are in the environment: workers inherit them)
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, configure_logging=False)
    yield
    ray.shutdown()


def _matrix(tmp_path: Path, url: str, models: list[str], targets: list[str], quantize: list[str]) -> Path:
    (tmp_path / "nets.py").write_text(NETS)
    path = tmp_path / "matrix.toml"
    path.write_text(textwrap.dedent(f"""
        models = {json.dumps(models)}
        targets = {json.dumps(targets)}
        quantize = {json.dumps(quantize)}
        out = "{url}/bundles"
        cache = "{url}/cache"
        [options]
        generate = false
    """))
    return path


def _run(path: Path, tmp_path: Path, *extra: str) -> tuple[int, dict]:
    out = tmp_path / f"rows-{len(list(tmp_path.glob('rows-*')))}.json"
    code = cli.main(["compile-matrix", str(path), "--json", str(out), *extra])
    return code, {r["cell"]: r for r in json.loads(out.read_text())["rows"]}


def _eager(tmp_path: Path, factory: str = "small_cnn"):
    import importlib.util

    spec = importlib.util.spec_from_file_location("nets_eager", tmp_path / "nets.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, inputs = getattr(module, factory)()
    with torch.no_grad():
        return model(**inputs), inputs


@pytest.mark.slow  # 40-50 s (a worker killed, its cell rebuilt); a failing cell on Ray stays in the default suite
def test_a_matrix_on_ray_builds_shares_its_cache_and_survives_a_dead_worker(local_ray, bucket, tmp_path):  # noqa: F811
    url, fs = bucket
    path = _matrix(tmp_path, url, ["nets.py:small_cnn", "nets.py:dies_once"], ["ort", "xnnpack", "qnn"], ["float", "int8"])
    code, cold = _run(path, tmp_path)
    assert code == 0 and len(cold) == 12, cold
    for row in cold.values():  # a target that took nothing says why (xnnpack: the int8 conv net's convolution)
        assert row["matches"] and (row["status"] == "ok" or (row["status"] == "refused" and row["refusal"])), row
    # the dying factory's cells: the first to run lost its worker, Ray ran it again, the row says so
    retried = [r for r in cold.values() if r["retried"]]
    assert len(retried) == 1 and retried[0]["attempts"] == 2 and retried[0]["cell"].startswith("nets:dies_once"), cold
    assert (tmp_path / "died").exists()
    # every bundle loads from the bucket here and matches eager (a third process: this one)
    eager = {"small_cnn": _eager(tmp_path), "dies_once": _eager(tmp_path, "mlp")}
    for row in cold.values():
        expected, inputs = eager[row["cell"].split(":")[1].split("-")[0]]
        got = torchnative.load(row["bundle"])(**inputs)["output"]
        bound = 0.05 if row["target"] == "qnn" or row["quantize"] == "int8" else 1e-4
        torch.testing.assert_close(got, expected, rtol=0, atol=bound * expected.abs().max().item())

    code, warm = _run(path, tmp_path)  # served from the shared cache: nothing compiled again
    assert code == 0 and [r["status"] for r in warm.values()] == [r["status"] for r in cold.values()]
    for name, row in warm.items():
        if row["status"] == "ok":
            assert row["cache"].get("hits", 0) >= 1 and "misses" not in row["cache"], (name, row["cache"])
    assert sum(r["compile_s"] for r in warm.values()) < 0.5 * sum(r["compile_s"] for r in cold.values())

    entries = [p for p in fs.find(f"{url.removeprefix('s3://')}/cache") if p.endswith(".entry")]
    damaged = entries[0]
    fs.pipe_file(damaged, fs.cat_file(damaged)[:-7] + b"garbage")
    code, third = _run(path, tmp_path)
    assert code == 0 and [r["status"] for r in third.values()] == [r["status"] for r in cold.values()]
    corrupt = [r for r in third.values() if r["cache"].get("corrupt")]
    assert corrupt and all(r["cache"].get("misses") for r in corrupt), third  # detected, rebuilt
    assert fs.cat_file(damaged)[-7:] != b"garbage"  # and written whole again


def test_a_failing_cell_is_a_row_and_the_others_complete(local_ray, bucket, tmp_path):  # noqa: F811
    url, _ = bucket
    path = _matrix(tmp_path, url, ["nets.py:small_cnn", "nets.py:no_such_factory"], ["ort"], ["float"])
    code, rows = _run(path, tmp_path)
    assert code == 1
    assert rows["nets:small_cnn-ort-float"]["status"] == "ok"
    failed = rows["nets:no_such_factory-ort-float"]
    assert failed["status"] == "failed" and "no callable 'no_such_factory'" in failed["error"]


def test_serial_builds_the_same_cells_without_ray(tmp_path):
    from torchnative import store

    before = store.place()
    path = _matrix(tmp_path, str(tmp_path), ["nets.py:small_cnn"], ["ort"], ["float", "int4"])
    code, rows = _run(path, tmp_path, "--serial")
    assert code == 0 and {r["status"] for r in rows.values()} == {"ok"} and len(rows) == 2
    assert all(Path(r["bundle"]).is_dir() for r in rows.values())
    assert store.place() is before  # the cells' cache was theirs, not this process's from then on


@pytest.mark.parametrize("text, message", [
    ("targets = ['ort']", "needs models"),
    ("models = ['a.py:f']\ntargets = ['ort']\nquantize = ['int3']", "quantize takes float, int8 and int4"),
    ("models = ['a.py:f']\ntargets = ['ort']\n[options]\nbatch = 2", "takes generate, cache_len"),
    ("models = ['transformers:BertModel --layers 2']\ntargets = ['ort']", "expected"),
])
def test_a_wrong_matrix_file_is_refused_with_where(tmp_path, text, message):
    path = tmp_path / "m.toml"
    path.write_text(text)
    with pytest.raises(matrix_cli.MatrixError, match=message):
        matrix_cli.read(path)


@pytest.mark.slow
def test_two_models_three_targets_two_quantizations(local_ray, bucket, tmp_path):  # noqa: F811
    """Tiny BERT and a conv net × ort, xnnpack, qnn × float, int8 (a transformers model beside the
    default suite's small nets); every bundle loads from the bucket and matches eager; the second
    run compiles nothing."""
    from torchnative import models

    url, _ = bucket
    path = _matrix(tmp_path, url, ["transformers:BertModel --config tiny", "nets.py:small_cnn"],
                   ["ort", "xnnpack", "qnn"], ["float", "int8"])
    code, cold = _run(path, tmp_path)
    assert code == 0 and len(cold) == 12
    for row in cold.values():  # a target that took nothing says why (xnnpack: the int8 conv net)
        assert row["status"] == "ok" or (row["status"] == "refused" and row["refusal"]), row
    bert = models.transformers_model("BertModel", "tiny")
    bert_inputs = models.default_inputs(bert)
    with torch.no_grad():
        bert_expected = bert(**bert_inputs).last_hidden_state
    cnn_expected, cnn_inputs = _eager(tmp_path)
    for row in cold.values():
        loaded = torchnative.load(row["bundle"])
        got, expected = ((loaded(**bert_inputs)["last_hidden_state"], bert_expected) if row["cell"].startswith("Bert")
                         else (loaded(**cnn_inputs)["output"], cnn_expected))
        bound = 0.05 if row["target"] == "qnn" or row["quantize"] == "int8" else 1e-4
        torch.testing.assert_close(got, expected, rtol=0, atol=bound * expected.abs().max().item())
    code, warm = _run(path, tmp_path)
    assert code == 0
    for name, row in warm.items():
        if row["status"] == "ok":
            assert "misses" not in row["cache"] and row["cache"].get("hits"), (name, row["cache"])

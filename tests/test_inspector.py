"""The profiling inspector on a real model: its figures agree with stats(), every fallback and
graph break that explain() sees is in the report, the HTML renders in Chromium, the trace is
valid Chrome trace JSON."""
import json
import os
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import pytest
import torch

import torchnative
from torchnative import cli, events, models
from torchnative.delegates import REGISTRY
from torchnative.delegates.eager import delegate as eager
from torchnative.inspector.html import write_html
from torchnative.inspector.report import short_path
from torchnative.inspector.perfetto import trace_events, write_trace
from tests.conftest import record

DELEGATES = ["candle", "ort"]
ARTIFACTS = Path(os.environ.get("TORCHNATIVE_TEST_ARTIFACTS", Path(__file__).parent.parent / "test-artifacts"))
pytestmark = pytest.mark.skipif(any(REGISTRY[d].available().status != "executes" for d in DELEGATES),
                                reason=f"needs {DELEGATES} executing here")


@pytest.fixture(scope="module")
def gpt2_profile():
    """GPT-2 (small config) accelerated with candle then ORT: an explain() and four calls
    without a KV cache (so the last ones replay) inside one profile, stats() reset at its start."""
    torch.manual_seed(0)
    model = models.build("gpt2", "tiny")
    inputs = models.example_inputs("gpt2", model)
    with torch.no_grad():
        reference = model(**inputs).logits
        torchnative.accelerate(model, delegates=DELEGATES)
        torchnative.reset_stats()
        with torchnative.profile() as prof:
            with torchnative.capture(DELEGATES, compile_after=1):
                explanation = torchnative.explain(model, **inputs)
            outs = [model(**inputs, use_cache=False).logits for _ in range(4)]
        stats = torchnative.stats()
    torchnative.deaccelerate(model)
    for out in outs:
        torch.testing.assert_close(out, reference, rtol=1e-4, atol=1e-5)
    return prof, stats, explanation


def test_summary_figures_agree_with_stats(gpt2_profile):
    prof, stats, _ = gpt2_profile
    c = prof.data["counters"]
    for name in ("ops_recorded", "graphs_built", "graph_runs", "cache_hits", "cache_misses", "replays", "replay_misses"):
        assert c[name] == stats[name], name
    assert c["replays"] > 0 and c["cache_hits"] > 0
    assert c["graph_breaks"] == sum(stats["syncs"].values())
    assert c["fallbacks"] == sum(stats["fallbacks"].values())
    text = prof.summary()
    assert f"{c['graph_runs']} graph runs" in text and f"{c['ops_recorded']} ops recorded" in text
    # every graph run ran each of its program's partitions once, and each run was timed
    runs = sum(len(p["times"]) for p in prof.data["partitions"])
    assert runs == len(prof.data["runs"]) > 0
    assert {p["delegate"] for p in prof.data["partitions"]} >= set(DELEGATES)
    times = prof.delegate_times()
    assert sum(times.values()) == pytest.approx(prof.data["wall_s"], rel=1e-6)


def test_each_partition_shows_its_gap_to_eager(gpt2_profile):
    """The build's check (build/verify.py) per partition: a delegate's within its tolerance."""
    prof, _, _ = gpt2_profile
    delegated = [p for p in prof.data["partitions"] if p["delegate"] in DELEGATES]
    assert delegated and all(p["gap"].endswith(("scale", "l2")) for p in delegated)
    assert all(float(p["gap"].split()[0]) < 1e-2 for p in delegated)
    assert "gap to eager" in prof.summary(width=400)


def test_a_declined_partition_shows_its_gap(monkeypatch):
    from tests.test_numeric_gap import _PlusOne, _mlp
    monkeypatch.setitem(REGISTRY, _PlusOne.name, _PlusOne())
    model, x = _mlp(), torch.randn(4, 16)
    with torch.no_grad(), torchnative.profile() as prof, torchnative.capture(["plus-one", "ort"], compile_after=1):
        y = model(x)
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-6)
    (declined,) = [p for p in prof.data["partitions"] if "declined" in p["gap"]]
    assert declined["delegate"] == "eager" and declined["gap"].startswith("5.6e-01 scale > 0.0001")
    assert declined["gap"] in prof.summary(width=400)


def test_every_break_and_source_line_is_in_the_report(gpt2_profile):
    prof, _, explanation = gpt2_profile
    text = prof.summary(width=400)
    assert explanation.breaks, "GPT-2's attention mask reads a value: there is a break to report"
    for b in explanation.breaks:
        assert short_path(b.filename, b.line) in text
    # each partition names the user source lines its ops came from: GPT-2's own modeling file
    sources = {f for p in prof.data["partitions"] for f, _, _ in p["sources"]}
    assert any(f.endswith("modeling_gpt2.py") for f in sources)
    for p in prof.data["partitions"]:
        assert sum(k for _, _, k in p["sources"]) == p["n_ops"]


class _FailsAtRun:
    """ORT's claims, but every compiled partition raises when it runs: a run-time fallback."""
    name = "ort-broken"

    def available(self):
        return REGISTRY["ort"].available()

    def supports(self, node):
        return REGISTRY["ort"].supports(node)

    def compile(self, graph):
        return eager.compile(graph)

    def load(self, artifact):
        def run(inputs):
            raise RuntimeError("injected run failure")
        return run


def test_every_fallback_is_in_the_report(monkeypatch):
    monkeypatch.setitem(REGISTRY, "ort-broken", _FailsAtRun())
    model = models.build("gpt2", "tiny")
    inputs = models.example_inputs("gpt2", model)
    with torch.no_grad():
        reference = model(**inputs).logits
        with torchnative.profile() as prof:
            with torchnative.capture(["candle", "ort-broken"], compile_after=1):
                explanation = torchnative.explain(model, **inputs)
    torch.testing.assert_close(explanation.output.logits, reference, rtol=1e-4, atol=1e-5)
    assert explanation.fallbacks
    text = prof.summary(width=400)
    for f in explanation.fallbacks:
        assert f"{f.delegate}" in text and f.reason in text
    assert len(prof.data["fallbacks"]) == len(explanation.fallbacks)
    # the partitions that fell back ran on eager, and the profile timed them there
    assert any(p["delegate"] == "eager" for p in prof.data["partitions"])


def test_nothing_is_timed_outside_a_profile():
    x = torch.randn(16, 16)
    with record(events.GraphRun, events.PartitionRun) as seen, torchnative.capture(["candle"], compile_after=1):
        (x @ x).relu().sum().item()
    assert any(isinstance(e, events.GraphRun) for e in seen)
    assert not any(isinstance(e, events.PartitionRun) for e in seen)
    assert events.timing is False


def test_trace_is_chrome_trace_event_json(gpt2_profile, tmp_path):
    prof, _, _ = gpt2_profile
    data = json.loads(write_trace(prof, tmp_path / "trace.json").read_text())
    assert isinstance(data["traceEvents"], list)
    for e in data["traceEvents"]:
        assert {"ph", "ts", "pid", "tid"} <= e.keys(), e
        assert e["ph"] in {"X", "i", "M"}
        if e["ph"] == "X":
            assert e["dur"] >= 0 and e["ts"] >= 0
    tracks = {e["args"]["name"]: e["tid"] for e in data["traceEvents"] if e["name"] == "thread_name"}
    for d in DELEGATES:  # one track per delegate, holding exactly its partition runs
        runs = [e for e in data["traceEvents"] if e["ph"] == "X" and e["tid"] == tracks[d]]
        assert len(runs) == sum(len(p["times"]) for p in prof.data["partitions"] if p["delegate"] == d) > 0
    assert trace_events(prof) == data


def _png_colors(path: Path) -> int:
    """Distinct byte values in a PNG's decompressed image data (1 for a blank page)."""
    raw, pos, idat = path.read_bytes(), 8, b""
    while pos < len(raw):
        length, kind = struct.unpack(">I4s", raw[pos:pos + 8])
        if kind == b"IDAT":
            idat += raw[pos + 8:pos + 8 + length]
        pos += 12 + length
    return len(set(zlib.decompress(idat)))


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


@pytest.mark.skipif(CHROMIUM is None, reason="Debian's chromium is not installed (apt-get install chromium)")
def test_html_report_renders_in_chromium(gpt2_profile, tmp_path):
    prof, _, _ = gpt2_profile
    page = write_html(prof, tmp_path / "report.html")
    assert "<script" not in page.read_text() and "http" not in page.read_text().replace("http://www.w3.org", "")
    flags = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--window-size=1200,1800"]
    dom = subprocess.run(flags + ["--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    for plot in ("plot-time", "plot-timeline", "plot-coverage"):
        start = dom.index(f'id="{plot}"')
        assert dom.count("<rect", start, dom.index("</svg>", start)) > 0, plot
    assert "Top partitions by time" in dom
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    shot = ARTIFACTS / "inspector_report.png"
    shot.unlink(missing_ok=True)
    subprocess.run(flags + [f"--screenshot={shot}", page.as_uri()], capture_output=True, timeout=120)
    assert shot.exists() and _png_colors(shot) > 16, "the screenshot is blank"


def test_cli_inspect(gpt2_profile, tmp_path, capsys):
    prof, _, _ = gpt2_profile
    path = prof.save(tmp_path / "p.json")
    assert cli.main(["inspect", str(path), "--html", str(tmp_path / "r.html"), "--trace", str(tmp_path / "t.json")]) == 0
    out = capsys.readouterr().out
    assert "Time and op coverage per delegate" in out and "Top partitions by time" in out
    assert (tmp_path / "r.html").stat().st_size > 0 and json.loads((tmp_path / "t.json").read_text())["traceEvents"]
    assert torchnative.Profile.load(path).data == json.loads(json.dumps(prof.data))


@pytest.mark.parametrize("content, message", [
    ("not json", "is not a torchnative profile"),
    ('{"a": 1}', "not a torchnative profile (no 'schema' field)"),
    ('{"schema": 99}', "has profile schema 99; this torchnative reads up to 1"),
])
def test_cli_inspect_rejects_what_is_not_a_profile(tmp_path, capsys, content, message):
    path = tmp_path / "bad.json"
    path.write_text(content)
    assert cli.main(["inspect", str(path)]) == 2
    assert message in capsys.readouterr().err

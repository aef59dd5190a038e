"""A profile as one self-contained HTML page: inline SVG plots (time per delegate, timeline of
partition runs, op coverage) above the same tables as the terminal view. No scripts, no links."""
from __future__ import annotations

import html
import io
from pathlib import Path
from typing import TYPE_CHECKING

from torchnative.inspector.report import console, show, tables

if TYPE_CHECKING:
    from torchnative.inspector.profile import Profile

PALETTE = ["#4e79a7", "#f28e2b", "#59a14f", "#e15759", "#76b7b2", "#edc948", "#b07aa1", "#9c755f", "#bab0ac"]
WIDTH, LABEL, ROW = 900, 170, 26


def _color(names: list[str]) -> dict[str, str]:
    return {n: PALETTE[i % len(PALETTE)] for i, n in enumerate(names)}


def _bars(plot_id: str, title: str, values: dict[str, float], unit: str, colors: dict[str, str]) -> str:
    top = max(values.values(), default=0) or 1
    rows = []
    for i, (name, v) in enumerate(values.items()):
        y = 10 + i * ROW
        w = (WIDTH - LABEL - 90) * v / top
        rows.append(f'<text x="{LABEL - 8}" y="{y + 15}" text-anchor="end">{html.escape(name)}</text>'
                    f'<rect class="bar" x="{LABEL}" y="{y}" width="{w:.1f}" height="{ROW - 6}" fill="{colors.get(name, "#999")}">'
                    f'<title>{html.escape(name)}: {v:.4g} {unit}</title></rect>'
                    f'<text x="{LABEL + w + 6:.1f}" y="{y + 15}">{v:.4g} {unit}</text>')
    return _figure(plot_id, title, 20 + len(values) * ROW, "".join(rows))


def _timeline(prof: "Profile", colors: dict[str, str]) -> str:
    """Partition runs on one lane per delegate, program builds on their own lane."""
    d = prof.data
    delegate = {p["id"]: p["delegate"] for p in d["partitions"]}
    spans = [(delegate[pid], start, dur, f"{pid}: {dur * 1e3:.3f} ms") for pid, start, dur in d["runs"]]
    spans += [("building programs", c["t"] - c["seconds"], c["seconds"], f"build {c['graph']}: {c['seconds']:.2f} s")
              for c in d["compiles"]]
    lanes = [n for n in colors if any(s[0] == n for s in spans)]
    end = max((s + t for _, s, t, _ in spans), default=0) or 1
    scale = (WIDTH - LABEL - 20) / end
    body = [f'<text x="{LABEL - 8}" y="{10 + i * ROW + 15}" text-anchor="end">{html.escape(n)}</text>' for i, n in enumerate(lanes)]
    for lane, start, dur, tip in spans:
        body.append(f'<rect class="run" x="{LABEL + start * scale:.2f}" y="{10 + lanes.index(lane) * ROW}" '
                    f'width="{max(dur * scale, 0.5):.2f}" height="{ROW - 6}" fill="{colors[lane]}">'
                    f'<title>{html.escape(tip)} at {start * 1e3:.3f} ms</title></rect>')
    axis_y = 14 + len(lanes) * ROW
    body.append(f'<text x="{LABEL}" y="{axis_y + 10}">0 ms</text>'
                f'<text x="{WIDTH - 20}" y="{axis_y + 10}" text-anchor="end">{end * 1e3:.1f} ms</text>')
    return _figure("plot-timeline", "Timeline: partition runs per delegate, program builds", axis_y + 16, "".join(body))


def _figure(plot_id: str, title: str, height: int, body: str) -> str:
    return (f'<figure><figcaption>{html.escape(title)}</figcaption>'
            f'<svg class="plot" id="{plot_id}" xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{height}" '
            f'font-family="sans-serif" font-size="12">{body}</svg></figure>')


def render_html(prof: "Profile") -> str:
    times, coverage = prof.delegate_times(), prof.coverage()
    colors = _color(list(times))
    con = console(160, record=True, file=io.StringIO())
    show(con, tables(prof))
    body = con.export_html(inline_styles=True, code_format="{code}")
    return ("<!DOCTYPE html><html><head><meta charset='utf-8'><title>torchnative profile</title>"
            "<style>body{font-family:sans-serif;margin:24px;max-width:1200px}figure{margin:16px 0}"
            "figcaption{font-weight:bold;margin-bottom:4px}pre{font-size:12px;line-height:1.3}</style></head><body>"
            "<h1>torchnative profile</h1>"
            + _bars("plot-time", "Time per delegate", {k: v * 1e3 for k, v in times.items()}, "ms", colors)
            + _timeline(prof, colors)
            + _bars("plot-coverage", "Ops run per delegate", {k: float(v) for k, v in coverage.items()}, "ops", colors)
            + f"<pre>{body}</pre></body></html>")


def write_html(prof: "Profile", path: str | Path) -> Path:
    path = Path(path)
    path.write_text(render_html(prof), encoding="utf-8")
    return path

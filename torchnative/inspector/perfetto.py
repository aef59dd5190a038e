"""A profile as Chrome trace events (opens in Perfetto / chrome://tracing): one track per
delegate with every partition run, one for compiles, one for graph breaks."""
from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torchnative.inspector.profile import Profile

PID = 1


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def trace_events(prof: "Profile") -> dict:
    d = prof.data
    parts = {p["id"]: p for p in d["partitions"]}
    tracks = ["graph breaks", "compile"] + sorted({p["delegate"] for p in d["partitions"]})
    tid = {name: i + 1 for i, name in enumerate(tracks)}
    out = [{"ph": "M", "name": "process_name", "pid": PID, "tid": 0, "ts": 0, "args": {"name": "torchnative"}}]
    out += [{"ph": "M", "name": "thread_name", "pid": PID, "tid": tid[n], "ts": 0, "args": {"name": n}} for n in tracks]
    for pid_, start, dur in d["runs"]:
        p = parts[pid_]
        out.append({"ph": "X", "name": f"{p['id']} ({p['n_ops']} ops)", "cat": p["delegate"], "pid": PID,
                    "tid": tid[p["delegate"]], "ts": _us(start), "dur": _us(dur),
                    "args": {"ops": p["n_ops"], "sources": [f"{f}:{line}" for f, line, _ in p["sources"][:5]]}})
    for c in d["compiles"]:
        out.append({"ph": "X", "name": f"build {c['graph']}", "cat": "compile", "pid": PID, "tid": tid["compile"],
                    "ts": _us(c["t"] - c["seconds"]), "dur": _us(c["seconds"]),
                    "args": {"partitions": [f"{dl} {n} ops" for dl, n, _, _ in c["partitions"]]}})
    for b in d["breaks"]:
        out.append({"ph": "i", "s": "t", "name": b["reason"].split(":")[0], "cat": "graph break", "pid": PID,
                    "tid": tid["graph breaks"], "ts": _us(b["t"]), "args": {"where": f"{b['file']}:{b['line']}",
                                                                          "reason": b["reason"]}})
    return {"traceEvents": out, "displayTimeUnit": "ms"}


def write_trace(prof: "Profile", path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(trace_events(prof)))
    return path

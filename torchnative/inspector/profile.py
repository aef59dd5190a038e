"""`profile()`: the events of a block turned into one JSON-able record of where time went, what
fell back and why, where the graph broke, and which tensors were state or pinned."""
from __future__ import annotations

import json
import statistics
import time
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import torch

from torchnative import events
from torchnative.passes.pin import updatable

SCHEMA = 1


class ProfileError(ValueError):
    """A profile file that cannot be read."""


def _percentile(xs: list[float], q: float) -> float:
    if len(xs) == 1:
        return xs[0]
    return statistics.quantiles(xs, n=100, method="inclusive")[round(q * 100) - 1]


def source_lines(graph: Any) -> list[list]:
    """User source lines of a graph's ops, most ops first: [file, line, ops]."""
    counts = Counter(tuple(n.meta.get("stack") or ("<unknown>", 0)) for n in graph.op_nodes())
    return [[f, line, k] for (f, line), k in counts.most_common()]


class Collector:
    """Listens to events while a profile is open and keeps what the report needs."""

    def __init__(self) -> None:
        self.start = time.perf_counter()
        self.programs: dict[int, Any] = {}
        self.partitions: dict[tuple, dict] = {}
        self.runs: list[list] = []
        self.breaks: list[dict] = []
        self.fallbacks: list[dict] = []
        self.compiles: list[dict] = []
        self.graph_runs: list[events.GraphRun] = []
        self.replay: Counter = Counter()
        self.ineligible: Counter = Counter()

    def __call__(self, e: Any) -> None:
        t = time.perf_counter() - self.start
        if isinstance(e, events.PartitionRun):
            part = self._partition(e.graph_key, e.index, e.step)
            part["times"].append(e.seconds)
            self.runs.append([part["id"], e.start - self.start, e.seconds])
        elif isinstance(e, events.GraphRun):
            self.graph_runs.append(e)
            if e.program is not None:
                self.programs.setdefault(id(e.program), e.program)
        elif isinstance(e, events.GraphBreak):
            self.breaks.append({"reason": e.reason, "op": e.op, "file": e.filename, "line": e.line, "t": t})
        elif isinstance(e, events.Fallback):
            self.fallbacks.append({"delegate": e.delegate, "reason": e.reason, "graph": e.graph_key[:12], "n_ops": e.n_ops})
        elif isinstance(e, events.ProgramBuilt):
            self.compiles.append({"graph": e.program.graph.key[:12], "seconds": e.seconds, "t": t,
                                  "partitions": [[s.delegate, len(s.graph.op_nodes()), s.compile_s, s.artifact_bytes]
                                                 for s in e.program.steps]})
        elif isinstance(e, events.ReplayOutcome):
            self.replay[e.outcome] += 1
            if e.reason:
                self.ineligible[e.reason] += 1

    def _partition(self, key: str, index: int, step: Any) -> dict:
        # one graph may run as an eager-tier program before its compiled one (compile_after),
        # and a partition that fails at run time moves to eager: the delegate is part of the id
        part = self.partitions.get((key, index, step.delegate))
        if part is None:
            part = self.partitions[(key, index, step.delegate)] = {
                "id": f"{key[:12]}#{index}/{step.delegate}", "graph": key[:12], "index": index, "delegate": step.delegate,
                "n_ops": len(step.graph.op_nodes()), "ops": dict(step.graph.op_counts()),
                "sources": source_lines(step.graph), "compile_s": step.compile_s,
                "artifact_bytes": step.artifact_bytes, "times": [], "gap": _gap(step.verdict)}
        return part

    def record(self, wall_s: float) -> dict:
        declined: Counter = Counter()
        tensors: list[dict] = []
        for program in self.programs.values():
            declined.update(program.declined)
            tensors += updatable(program.graph)
        runs = self.graph_runs
        counters = {
            "ops_recorded": sum(r.n_ops_recorded for r in runs),
            "graphs_built": len(self.compiles),
            "graph_runs": len(runs),
            "cache_hits": sum(r.cache_hit and not r.replayed for r in runs),
            "cache_misses": sum(not r.cache_hit for r in runs),
            "replays": self.replay["replayed"],
            "replay_misses": self.replay["miss"],
            "eager_calls": self.replay["eager"],
            "graph_breaks": len(self.breaks),
            "fallbacks": len(self.fallbacks),
        }
        return {
            "schema": SCHEMA, "torch": torch.__version__, "wall_s": wall_s, "counters": counters,
            "partitions": list(self.partitions.values()), "runs": self.runs, "breaks": self.breaks,
            "fallbacks": self.fallbacks, "compiles": self.compiles, "tensors": tensors,
            "declined": [{"op": op, "delegate": d, "reason": why, "count": k} for (op, d, why), k in declined.most_common()],
            "replay_ineligible": dict(self.ineligible),
        }


class Profile:
    """What ran inside a `torchnative.profile()` block (`data`: the JSON-able record)."""

    def __init__(self, data: dict | None = None) -> None:
        self.data: dict = data or {}

    # -- derived figures, shared by the text, HTML and trace views -----------------------------
    def delegate_times(self) -> dict[str, float]:
        """Seconds per delegate, most first, then `building programs` (partitioning and
        compiling) and `outside partitions` (Python, recording at the door, replay guards)."""
        per: Counter = Counter()
        for p in self.data["partitions"]:
            per[p["delegate"]] += sum(p["times"])
        building = sum(c["seconds"] for c in self.data["compiles"])
        outside = max(self.data["wall_s"] - sum(per.values()) - building, 0.0)
        return {**dict(per.most_common()), "building programs": building, "outside partitions": outside}

    def coverage(self) -> dict[str, int]:
        """Ops run per delegate, counting each partition once per run."""
        ops: Counter = Counter()
        for p in self.data["partitions"]:
            ops[p["delegate"]] += p["n_ops"] * len(p["times"])
        return dict(ops.most_common())

    def top_partitions(self, n: int = 10) -> list[dict]:
        rows = []
        for p in self.data["partitions"]:
            t = sorted(p["times"])
            rows.append({**p, "runs": len(t), "total_s": sum(t), "p50_s": _percentile(t, 0.5),
                         "p95_s": _percentile(t, 0.95)})
        return sorted(rows, key=lambda r: -r["total_s"])[:n]

    def breaks_by_line(self) -> list[tuple[str, int, str, int]]:
        """(file, line, reason, count), most frequent first."""
        c = Counter((b["file"], b["line"], b["reason"].split(":")[0]) for b in self.data["breaks"])
        return [(f, line, why, k) for (f, line, why), k in c.most_common()]

    # -- views ---------------------------------------------------------------------------------
    def summary(self, width: int = 140) -> str:
        """The report as plain text tables."""
        from torchnative.inspector.report import render_text

        return render_text(self, width)

    def save(self, path: str | Path) -> Path:
        """Write the profile as JSON (read it back with `Profile.load` or `torchnative inspect`)."""
        path = Path(path)
        path.write_text(json.dumps(self.data))
        return path

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        try:
            data = json.loads(path.read_text())
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ProfileError(f"{path} is not a torchnative profile: {e}. Write one with "
                               f"`with torchnative.profile() as p: ...; p.save(path)`.") from e
        if not isinstance(data, dict) or "schema" not in data:
            raise ProfileError(f"{path} is JSON but not a torchnative profile (no 'schema' field).")
        if data["schema"] > SCHEMA:
            raise ProfileError(f"{path} has profile schema {data['schema']}; this torchnative reads up to "
                               f"{SCHEMA}. Upgrade torchnative to read it.")
        return cls(data)


@contextmanager
def profile() -> Iterator[Profile]:
    """Record what torchnative does inside the block; the Profile is filled when it ends."""
    prof = Profile()
    collector = Collector()
    stop = events.listen(collector)
    previous, events.timing = events.timing, True
    try:
        yield prof
    finally:
        wall = time.perf_counter() - collector.start
        events.timing = previous
        stop()
        prof.data = collector.record(wall)


def _gap(verdict: Any) -> str:
    """The build's check of a partition (build/verify.py), as the report shows it: its worst
    output's gap to eager in its tolerance's measure, and `declined` for one that runs on eager."""
    if verdict is None:
        return ""
    if verdict.error:
        return "failed: declined"
    shown = f"{verdict.gap:.1e} {verdict.tolerance.kind}"
    return shown if verdict.ok else f"{shown} > {verdict.tolerance.bound:g}: declined"

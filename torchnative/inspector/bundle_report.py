"""A bundle's manifest as tables: what was captured, how it is partitioned, what each file holds,
and whether every file still matches its hash."""
from __future__ import annotations

from collections import Counter
from typing import Iterator

from rich.table import Table
from rich.text import Text

from torchnative.bundle.format import Reader, sha256
from torchnative.inspector.report import short_path


def _table(title: str, *columns: str) -> Table:
    table = Table(title=title, title_justify="left")
    for c in columns:
        table.add_column(c)
    return table


def _short(op: str) -> str:
    """aten.view.default → view, aten.add.Tensor → add.Tensor."""
    return op.removeprefix("aten.").removesuffix(".default")


def _integrity(reader: Reader, spec: dict, name: str) -> str:
    """A word for a table's narrow column; `_problem` says more."""
    if not reader.has(name):
        return "MISSING"
    data = reader.read(name)
    if len(data) != spec["bytes"]:
        return "TRUNCATED"
    return "ok" if sha256(data) == spec["sha256"] else "HASH MISMATCH"


def _problem(reader: Reader, spec: dict, name: str) -> str:
    word = _integrity(reader, spec, name)
    if word == "TRUNCATED":
        return f"{name}: TRUNCATED or replaced ({len(reader.read(name))} of {spec['bytes']} bytes)"
    return f"{name}: {word}" + (": modified or corrupted" if word == "HASH MISMATCH" else "")


def bundle_tables(path: str) -> Iterator[Table | Text]:
    reader = Reader(path)
    m = reader.manifest()
    yield Text(f"bundle {path} (schema {m['schema']})\nmodel {m['model']}\nwritten {m['created']}\n"
               f"toolchain: " + ", ".join(f"{k} {v}" for k, v in m["toolchain"].items()))
    io = _table("methods: inputs and outputs", "method", "", "name", "dtype / source", "shape")
    for name, method in m["methods"].items():
        for i in method["inputs"]:
            io.add_row(name, "input", i["name"], i["dtype"], str(i["shape"]))
        for o in method["outputs"]:
            io.add_row(name, "output", o["name"], next(iter(o["from"])), "")
    yield io
    if m["state"]:
        state = _table("state (every method reads and writes it)", "name", "dtype", "shape")
        for s in m["state"]:
            state.add_row(s["name"], s["dtype"], str(s["shape"]))
        yield state
    parts = _table("partitions in execution order (method graph.partition)", "partition", "delegate", "ops", "KiB",
                   "build s", "top ops", "file")
    per = Counter()
    programs = [(name, k, g) for name, method in m["methods"].items() for k, g in enumerate(method["programs"])]
    for name, k, g in programs:
        for j, p in enumerate(g["partitions"]):
            top = ", ".join(f"{n}×{_short(op)}" for op, n in Counter(p["op_counts"]).most_common(3))
            parts.add_row(f"{name} {k}.{j}", p["delegate"], str(p["ops"]), f"{p['bytes'] / 1024:.0f}",
                          f"{p['compile_s']:.2f}", top, _integrity(reader, p, p["artifact"]))
            per[p["delegate"]] += p["ops"]
    yield parts
    files = [(p, p["artifact"]) for *_, g in programs for p in g["partitions"]] + [(m["weights"], m["weights"]["file"])]
    problems = [_problem(reader, spec, name) for spec, name in files if _integrity(reader, spec, name) != "ok"]
    if problems:
        yield Text("\n".join(problems), style="bold red")
    total = sum(per.values()) or 1
    yield Text("op coverage: " + ", ".join(f"{d} {100 * n / total:.0f}%" for d, n in per.most_common()))
    w = m["weights"]
    checks = [c for _, _, g in programs for c in g["checks"]]
    extra = _table("weights, pinned tensors and path checks", "what", "detail")
    extra.add_row(w["file"], f"{w['bytes'] / 1024:.0f} KiB, {len(w['tensors'])} tensors, "
                              f"{_integrity(reader, w, w['file'])}")
    for p in m["pinned"]:
        extra.add_row(f"pinned {p['name']}", p["reason"])
    for c in checks:
        filename, _, line = c["at"].rpartition(":")
        extra.add_row("path check", f"{c['op']} at {short_path(filename, int(line or 0))} must read {c['equals']!r}")
    yield extra

"""A profile as tables (rich): the terminal view, `Profile.summary()`, and the HTML page's body."""
from __future__ import annotations

import io
from pathlib import PurePath
from typing import TYPE_CHECKING, Iterable, Iterator

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

if TYPE_CHECKING:
    from torchnative.inspector.profile import Profile


def short_path(filename: str, line: int) -> str:
    """A source path from its package (after site-packages), else its last three parts."""
    parts = PurePath(filename).parts
    if "site-packages" in parts:
        parts = parts[len(parts) - parts[::-1].index("site-packages"):]
    return f"{'/'.join(parts[-3:])}:{line}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.2f}"


def _partition(p: dict) -> str:
    return f"{p['graph'][:8]}#{p['index']}"


def _table(title: str, *columns: str) -> Table:
    # no vertical rules: two columns less of borders in 80
    t = Table(title=title, title_justify="left", title_style="bold", box=box.SIMPLE_HEAD)
    for c in columns:
        t.add_column(c, overflow="fold")
    return t


def tables(prof: "Profile") -> Iterator[Table | Text]:
    d = prof.data
    c = d["counters"]
    yield Text(f"{d['wall_s'] * 1e3:.1f} ms profiled · {c['graph_runs']} graph runs ({c['replays']} replayed calls, "
               f"{c['cache_hits']} program cache hits, {c['cache_misses']} misses) · {c['ops_recorded']} ops recorded · "
               f"{c['graphs_built']} programs built · {c['graph_breaks']} graph breaks · {c['fallbacks']} fallbacks")

    times, coverage = prof.delegate_times(), prof.coverage()
    total_time, total_ops = sum(times.values()) or 1.0, sum(coverage.values()) or 1
    t = _table("Time and op coverage per delegate", "delegate", "time ms", "time share", "ops run", "op share")
    for name, s in times.items():
        ops = coverage.get(name)
        t.add_row(name, _ms(s), f"{s / total_time:.1%}", "-" if ops is None else str(ops),
                  "-" if ops is None else f"{ops / total_ops:.1%}")
    yield t

    top = prof.top_partitions()
    # build time and artifact size: the table of programs built
    t = _table("Top partitions by time", "partition", "delegate", "ops", "runs", "ms", "p50/p95 ms", "gap to eager")
    for p in top:
        t.add_row(_partition(p), p["delegate"], str(p["n_ops"]), str(p["runs"]), _ms(p["total_s"]),
                  f"{_ms(p['p50_s'])}/{_ms(p['p95_s'])}", p.get("gap", ""))
    yield t
    t = _table("Where their ops come from", "partition", "source lines (ops)")
    for p in top:
        src = ", ".join(f"{short_path(f, line)} ({k})" for f, line, k in p["sources"][:3])
        more = len(p["sources"]) - 3
        t.add_row(_partition(p), src + (f" and {more} more" if more > 0 else ""))
    yield t

    if d["declined"]:
        t = _table("Ops a delegate declined (they ran on the next delegate or eager)", "op", "delegate", "nodes", "reason")
        for r in d["declined"]:
            t.add_row(r["op"], r["delegate"], str(r["count"]), r["reason"])
        yield t
    if d["fallbacks"]:
        t = _table("Fallbacks (a partition that failed to compile or run, then ran on eager)", "delegate", "graph",
                   "ops", "reason")
        for f in d["fallbacks"]:
            t.add_row(f["delegate"], f["graph"], str(f["n_ops"]), f["reason"])
        yield t
    if d["breaks"]:
        t = _table("Graph breaks (Python needed a value)", "where", "reason", "count")
        for f, line, why, k in prof.breaks_by_line():
            t.add_row(short_path(f, line), why, str(k))
        yield t
    if d["tensors"]:
        t = _table("State and pinned tensors", "graph", "input", "role", "tensor", "why")
        for x in d["tensors"]:
            t.add_row(x["graph"], x["name"], x["role"], f"{x['dtype']}{x['shape']}", x["reason"])
        yield t
    if d["compiles"]:
        t = _table("Programs built during the profile", "graph", "seconds", "partitions (delegate ops compile-s KiB)")
        for cmp in d["compiles"]:
            parts = ", ".join(f"{dl} {n} {s:.2f}s {b / 1024:.0f}" for dl, n, s, b in cmp["partitions"])
            t.add_row(cmp["graph"], f"{cmp['seconds']:.2f}", parts)
        yield t
    if d["replay_ineligible"]:
        t = _table("Calls that could not be replayed", "reason", "calls")
        for why, k in d["replay_ineligible"].items():
            t.add_row(why, str(k))
        yield t


def console(width: int | None = None, **kwargs) -> Console:
    """`width` columns wide, else the terminal's (rich reads COLUMNS, else takes 80 off a terminal)."""
    return Console(width=width, **kwargs)


def show(con: Console, items: Iterable[Table | Text]) -> None:
    """Each table under its title, the title a line of its own: rich wraps a title inside its
    table's width, mid-phrase when the table is narrower."""
    for item in items:
        if isinstance(item, Table) and item.title:
            con.print(Text(str(item.title), style="bold"))
            item.title = None
        con.print(item)


def render_text(prof: "Profile", width: int = 140) -> str:
    out = io.StringIO()
    show(console(width, file=out, color_system=None, highlight=False), tables(prof))
    return out.getvalue()

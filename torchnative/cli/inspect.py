"""`torchnative inspect`: a profile in the terminal, as HTML, or as a Chrome trace."""
from __future__ import annotations

from pathlib import Path

import click


@click.command("inspect")
@click.argument("path")
@click.option("--html", metavar="FILE", default=None, help="also write a self-contained HTML report with plots")
@click.option("--trace", metavar="FILE", default=None, help="also write Chrome trace events (Perfetto)")
def inspect(path: str, html: str | None, trace: str | None) -> int:
    """Report on a profile (time per delegate, fallbacks, graph breaks) or a bundle (its partitions)."""
    from torchnative.inspector.html import write_html
    from torchnative.inspector.profile import Profile, ProfileError
    from torchnative.inspector.report import console, show, tables

    if Path(path).is_dir() or path.endswith(".zip"):
        return _bundle(path)
    try:
        prof = Profile.load(path)
    except ProfileError as e:
        click.echo(f"torchnative inspect: {e}", err=True)
        return 2
    show(console(), tables(prof))
    if html:
        click.echo(f"HTML report: {write_html(prof, html)}")
    if trace:
        from torchnative.inspector.perfetto import write_trace
        click.echo(f"Chrome trace (open in https://ui.perfetto.dev): {write_trace(prof, trace)}")
    return 0


def _bundle(path: str) -> int:
    from torchnative.bundle import BundleError
    from torchnative.inspector.bundle_report import bundle_tables
    from torchnative.inspector.report import console, show

    try:
        items = list(bundle_tables(path))
    except BundleError as e:
        click.echo(f"torchnative inspect: {e}", err=True)
        return 2
    show(console(), items)
    return 0

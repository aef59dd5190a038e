"""The `torchnative` command: demo, delegates, capture-and-compile, run, inspect, compile-matrix."""
from __future__ import annotations

import click

from torchnative.cli.bundle import capture_and_compile, run
from torchnative.cli.demo import demo
from torchnative.cli.inspect import inspect
from torchnative.cli.matrix import compile_matrix


@click.group(invoke_without_command=True, context_settings={"help_option_names": ["-h", "--help"]})
@click.pass_context
def cli(ctx: click.Context) -> int | None:
    """Graph capture at PyTorch's aten dispatch door, routed to on-device delegates."""
    if ctx.invoked_subcommand is None:
        return ctx.invoke(demo)


@cli.command("delegates")
def delegates() -> None:
    """List every delegate and whether it executes here (and why not, and how to fix it)."""
    import torchnative

    rows = torchnative.availability()
    width = max(map(len, rows))
    for name, a in rows.items():
        detail = "; ".join(x for x in (a.reason, f"install: {a.install_hint}" if a.install_hint and a.status != "executes" else "") if x)
        click.echo(f"{name:<{width}}  {a.status:<12}  {detail}")


cli.add_command(demo)
cli.add_command(inspect)
cli.add_command(capture_and_compile)
cli.add_command(run)
cli.add_command(compile_matrix)


def main(argv: list[str] | None = None) -> int:
    """Run the command line; returns the exit code (the console script and `python -m torchnative.cli`)."""
    try:
        result = cli.main(args=argv, prog_name="torchnative", standalone_mode=False)
    except click.exceptions.Exit as e:
        return e.exit_code
    except click.ClickException as e:
        e.show()
        return e.exit_code
    except click.Abort:
        click.echo("Aborted.", err=True)
        return 1
    return result if isinstance(result, int) else 0


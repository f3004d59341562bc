"""The `exlq` command: the SDK's client commands and the worker's, in one program."""

from __future__ import annotations

from typing import Annotated

import typer

from exlq._version import __version__
from exlq.ops.dead_cli import dead_app
from exlq.ops.queue_commands import exporter, top
from exlq.producer.cli import app
from exlq.producer.gateways.cli import gateway_app
from exlq.worker.cli import engines, up, worker

app.command(help=worker.__doc__)(worker)
app.command(help=up.__doc__)(up)
app.command(help=engines.__doc__)(engines)
app.command(help=exporter.__doc__)(exporter)
app.command(help=top.__doc__)(top)
app.add_typer(gateway_app)
app.add_typer(dead_app)


def _print_version(asked: bool) -> None:
    if asked:
        typer.echo(f"exlq {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    version: Annotated[
        bool,
        typer.Option(
            "--version", callback=_print_version, is_eager=True, help="print the version and exit"
        ),
    ] = False,
) -> None:
    pass


def main() -> None:
    app()

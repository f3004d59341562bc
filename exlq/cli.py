"""The `exlq` command: the SDK's client commands and the worker's, in one program."""

from __future__ import annotations

from exlq.producer.cli import app
from exlq.worker.cli import engines, up, worker

app.command(help=worker.__doc__)(worker)
app.command(help=up.__doc__)(up)
app.command(help=engines.__doc__)(engines)


def main() -> None:
    app()

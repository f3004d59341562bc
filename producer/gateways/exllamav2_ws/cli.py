"""`exlq gateway websocket`."""

from __future__ import annotations

import asyncio
import logging
import signal
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer

from exlq.logs import configure_logging, parse_log_format
from exlq.protocol.keys import DEFAULT_PREFIX

if TYPE_CHECKING:
    from exlq.producer.gateways.exllamav2_ws.server import WebSocketSettings

log = logging.getLogger(__name__)


def websocket(
    queue: Annotated[
        str,
        typer.Option("--queue", "-q", envvar="EXLQ_QUEUE", help="the queue (model) to serve"),
    ],
    redis_url: Annotated[
        str, typer.Option("--redis-url", envvar="EXLQ_REDIS_URL", help="Redis to use")
    ] = "redis://localhost:6379/0",
    prefix: Annotated[str, typer.Option("--prefix", envvar="EXLQ_PREFIX", help="key prefix")] = (
        DEFAULT_PREFIX
    ),
    host: Annotated[str, typer.Option("--host", envvar="EXLQ_HOST", help="address to bind")] = (
        "127.0.0.1"
    ),
    port: Annotated[
        int,
        typer.Option("--port", envvar="EXLQ_PORT", min=0, max=65535, help="port to listen on"),
    ] = 7862,
    tokenizer: Annotated[
        Path | None,
        typer.Option(
            "--tokenizer",
            envvar="EXLQ_TOKENIZER",
            exists=True,
            file_okay=False,
            help="the model's folder (tokenizer.json, and config.json for its end-of-text "
            "id): estimate_token and lefttrim_token need it",
        ),
    ] = None,
    max_backlog: Annotated[
        int,
        typer.Option(
            "--max-backlog",
            envvar="EXLQ_MAX_BACKLOG",
            min=0,
            help="jobs the queue may hold before an infer gets queue_full; 0: no limit",
        ),
    ] = 0,
    log_level: Annotated[str, typer.Option("--log-level", envvar="EXLQ_LOG_LEVEL")] = "INFO",
    log_format: Annotated[
        str,
        typer.Option(
            "--log-format",
            envvar="EXLQ_LOG_FORMAT",
            help="text, or json: one JSON object a line",
        ),
    ] = "text",
) -> None:
    """Serve exllamav2's WebSocket protocol from an exlq queue."""
    # Imported here: the exlq program starts without the gateway extra (websockets,
    # tokenizers) installed.
    from exlq.producer.gateways.exllamav2_ws.server import WebSocketSettings

    try:
        configure_logging(log_level, parse_log_format(log_format))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    settings = WebSocketSettings(
        queue=queue,
        redis_url=redis_url,
        prefix=prefix,
        host=host,
        port=port,
        tokenizer_dir=tokenizer,
        max_backlog=max_backlog,
    )
    try:
        asyncio.run(_serve_until_signal(settings))
    except ValueError as exc:
        raise _fail(str(exc)) from None
    except OSError as exc:  # the port is taken, the address is not this host's
        raise _fail(f"cannot listen on {host}:{port}: {exc}") from None


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


async def _serve_until_signal(settings: WebSocketSettings) -> None:
    from exlq.producer.gateways.exllamav2_ws.server import bound_port, running_gateway

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(signum, stop.set)
    async with running_gateway(settings) as server:
        log.info(
            "serving exllamav2's WebSocket protocol on ws://%s:%d from queue %r",
            settings.host,
            bound_port(server),
            settings.queue,
        )
        await stop.wait()

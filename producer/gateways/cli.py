"""`exlq gateway ...`: one command per gateway."""

from __future__ import annotations

import typer

from exlq.producer.gateways.exllamav2_ws.cli import websocket
from exlq.producer.gateways.openai_api.cli import openai

gateway_app = typer.Typer(
    name="gateway",
    help="Serve the queue to clients of other protocols: OpenAI's HTTP API, exllamav2's "
    "WebSocket server.",
    no_args_is_help=True,
)
gateway_app.command(name="openai", help=openai.__doc__)(openai)
gateway_app.command(name="websocket", help=websocket.__doc__)(websocket)

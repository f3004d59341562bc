"""The OpenAI gateway served by uvicorn on a free port, in a thread with its own event loop,
so that a test may call it with the sync client as well as the async one while its
workers run on the test's loop."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import uvicorn

from exlq.producer.gateways.openai_api.app import create_app
from exlq.producer.gateways.openai_api.settings import GatewaySettings


class GatewayServer:
    def __init__(self, settings: GatewaySettings) -> None:
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._socket.bind(("127.0.0.1", 0))
        self.port = self._socket.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        self.app = create_app(settings)
        config = uvicorn.Config(self.app, log_level="warning", lifespan="on")
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="gateway", daemon=True)

    def _run(self) -> None:
        asyncio.run(self._server.serve(sockets=[self._socket]))

    def start(self) -> GatewayServer:
        self._thread.start()
        deadline = time.monotonic() + 10
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.01)
        return self

    def stop(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()


@pytest.fixture
def start_gateway(redis_url: str) -> Iterator[Callable[..., GatewayServer]]:
    """Start gateways on the test's Redis (settings as keyword arguments); stopped at
    teardown."""
    started: list[GatewayServer] = []

    def start(**settings: Any) -> GatewayServer:
        server = GatewayServer(GatewaySettings(**{"redis_url": redis_url, **settings})).start()
        started.append(server)
        return server

    yield start
    for server in started:
        server.stop()

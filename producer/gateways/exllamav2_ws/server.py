"""The gateway's server: websockets on a host and port, health answers for probes, and
the queue's producer, from start to a graceful stop."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from http import HTTPStatus
from pathlib import Path

import redis.asyncio as aioredis
from websockets.asyncio.server import Server, ServerConnection, serve
from websockets.http11 import Request, Response

from exlq.producer.client import AsyncProducer
from exlq.producer.gateways.exllamav2_ws.gateway import Gateway
from exlq.producer.gateways.exllamav2_ws.tokens import ModelTokenizer
from exlq.producer.worker_watch import DEFAULT_STALE_AFTER_S
from exlq.protocol.command_packing import pack_in_c
from exlq.protocol.keys import DEFAULT_PREFIX, QueueKeys, check_name
from exlq.protocol.redis_credentials import RedisCredentials
from exlq.protocol.slot_routing import follow_slot

log = logging.getLogger(__name__)

# How long a readiness probe waits for Redis's PONG.
PING_TIMEOUT_S = 2.0


@dataclass(frozen=True, slots=True)
class WebSocketSettings:
    queue: str
    redis_url: str = "redis://localhost:6379/0"
    # EXLQ_REDIS_USERNAME / EXLQ_REDIS_PASSWORD: they override the URL's.
    redis_credentials: RedisCredentials = field(default_factory=RedisCredentials)
    prefix: str = DEFAULT_PREFIX
    host: str = "127.0.0.1"
    port: int = 7862  # exllamav2's example server's port
    tokenizer_dir: Path | None = None
    max_backlog: int = 0  # jobs a lane of the queue may hold before infer gets queue_full
    worker_stale_after_s: float = DEFAULT_STALE_AFTER_S
    # At a stop: how long infers whose jobs were cancelled may take to hear their end.
    drain_grace_s: float = 5.0
    # The largest message a client may send (websockets' default, as exllamav2's server).
    max_message_bytes: int = 2**20


class HealthChecks:
    """Plain HTTP answers on the WebSocket port, for Kubernetes probes: GET /healthz (the
    process serves) and GET /readyz (Redis answers PING). Any other path goes on to the
    WebSocket handshake."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def __call__(self, connection: ServerConnection, request: Request) -> Response | None:
        path = request.path.partition("?")[0]
        if path == "/healthz":
            return connection.respond(HTTPStatus.OK, "ok\n")
        if path == "/readyz":
            return await self._ready(connection)
        return None

    async def _ready(self, connection: ServerConnection) -> Response:
        try:
            async with asyncio.timeout(PING_TIMEOUT_S):
                await self._redis.ping()
        except Exception as exc:  # any failure means not ready; the probe says which
            reason = str(exc) or type(exc).__name__
            return connection.respond(HTTPStatus.SERVICE_UNAVAILABLE, f"Redis: {reason}\n")
        return connection.respond(HTTPStatus.OK, "ready\n")


@contextlib.asynccontextmanager
async def running_gateway(settings: WebSocketSettings) -> AsyncIterator[Server]:
    """Serve until the block ends; then close every connection (cancelling their jobs),
    let their infers end, and close the producer. Raises ValueError for a bad queue name
    or tokenizer folder."""
    check_name("queue", settings.queue)
    tokenizer = None
    if settings.tokenizer_dir is not None:
        tokenizer = ModelTokenizer.load(settings.tokenizer_dir)
    pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, timeout=None)
    settings.redis_credentials.apply_to(pool)
    follow_slot(pool, QueueKeys(settings.queue, settings.prefix).jobs)  # a cluster's node
    pack_in_c(pool)
    redis = aioredis.Redis(connection_pool=pool)
    producer = AsyncProducer(
        queue=settings.queue,
        prefix=settings.prefix,
        client=redis,
        max_backlog=settings.max_backlog,
        worker_stale_after_s=settings.worker_stale_after_s,
    )
    gateway = Gateway(producer, tokenizer)
    try:
        async with serve(
            gateway.serve_connection,
            settings.host,
            settings.port,
            process_request=HealthChecks(redis),
            max_size=settings.max_message_bytes,
        ) as server:
            yield server
    finally:
        await gateway.drain(settings.drain_grace_s)
        await producer.close()
        await redis.aclose(close_connection_pool=True)


def bound_port(server: Server) -> int:
    """The port the server listens on (the one picked, for port 0)."""
    port: int = server.sockets[0].getsockname()[1]
    return port

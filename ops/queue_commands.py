"""The commands that watch queues: `exlq exporter` (Prometheus) and `exlq top` (terminal).
Their modules (prometheus_client, rich's live view) are imported when a command runs, so
that the rest of the `exlq` command starts without them."""

from __future__ import annotations

import asyncio
from typing import Annotated

import typer
from redis.exceptions import RedisError

from exlq.protocol.keys import DEFAULT_PREFIX, check_name
from exlq.protocol.redis_credentials import RedisCredentials

RedisUrl = Annotated[
    str, typer.Option("--redis-url", envvar="EXLQ_REDIS_URL", help="Redis to read")
]
Prefix = Annotated[str, typer.Option("--prefix", envvar="EXLQ_PREFIX", help="key prefix")]
Queues = Annotated[
    list[str] | None,
    typer.Option(
        "--queue", "-q", help="a queue to show (repeat for more); default: every queue found"
    ),
]
DEFAULT_URL = "redis://localhost:6379/0"


def _checked(prefix: str, queues: list[str] | None) -> tuple[str, tuple[str, ...]]:
    try:
        return check_name("key prefix", prefix), tuple(
            check_name("queue name", queue) for queue in queues or ()
        )
    except ValueError as exc:
        raise typer.BadParameter(str(exc)) from None


def exporter(
    queue: Queues = None,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
    host: Annotated[str, typer.Option(help="address to listen on")] = "0.0.0.0",
    port: Annotated[int, typer.Option(min=0, max=65535, help="port to listen on")] = 9410,
    scrape_timeout: Annotated[
        float, typer.Option(min=0.1, help="seconds a scrape waits for Redis at most")
    ] = 5.0,
) -> None:
    """Serve every queue's backlog, dead letters and live workers as Prometheus metrics
    (read from Redis at each scrape; no worker needed), and /healthz."""
    from exlq.ops.exporter import Exporter, run_exporter

    prefix, queues = _checked(prefix, queue)
    try:
        server = Exporter(
            redis_url, prefix, queues, host=host, port=port, scrape_timeout_s=scrape_timeout
        )
    except OSError as exc:
        raise _fail(f"cannot listen on {host}:{port}: {exc}") from None
    except ValueError as exc:  # a Redis URL redis-py cannot read
        raise _fail(str(exc)) from None
    typer.echo(f"exlq exporter: http://{host}:{server.port}/metrics (reading {redis_url})")
    asyncio.run(run_exporter(server))


def top(
    queue: Queues = None,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
    interval: Annotated[float, typer.Option(min=0.1, help="seconds between refreshes")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="print one frame and exit")] = False,
) -> None:
    """A live view of queues (backlog, waiting, pending, jobs/s), workers and recent dead
    letters, read from Redis."""
    prefix, queues = _checked(prefix, queue)
    try:
        asyncio.run(_top(redis_url, prefix, queues, interval, once))
    except KeyboardInterrupt:
        pass
    except (RedisError, OSError, ValueError) as exc:
        raise _fail(f"Redis: {exc or type(exc).__name__}") from None


async def _top(
    redis_url: str, prefix: str, queues: tuple[str, ...], interval_s: float, once: bool
) -> None:
    import redis.asyncio as aioredis

    from exlq.ops.queue_stats import QueueReader
    from exlq.ops.top import watch

    client = aioredis.Redis.from_url(redis_url)
    RedisCredentials().apply_to(client.connection_pool)
    reader = QueueReader(client, prefix)
    try:
        await watch(reader, queues, interval_s, once)
    finally:
        await reader.clients.aclose()
        await client.aclose()


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)

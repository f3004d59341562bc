"""The `exlq` command's client side: submit jobs, follow them, print the wire schema."""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Annotated, Any

import typer
from redis.exceptions import RedisError

from exlq.producer.client import AsyncProducer
from exlq.producer.errors import ExlqError
from exlq.protocol.keys import DEFAULT_PREFIX
from exlq.protocol.models import DoneEvent, ErrorEvent, RequeuedEvent, TokenEvent, json_schemas

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
    except (RedisError, OSError) as exc:
        raise _fail(f"Redis: {exc}") from None
    except TimeoutError:
        raise _fail("timed out waiting for the job") from None


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
    timeout: Annotated[float | None, typer.Option(help="seconds to wait")] = None,
) -> None:
    """Submit a job and print its result (or its tokens as they arrive with --stream)."""
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
    _run(_submit(redis_url, queue, prefix, text, fields, stream, as_json, timeout))


async def _submit(
    redis_url: str,
    queue: str,
    prefix: str,
    prompt: str,
    fields: dict[str, Any],
    stream: bool,
    as_json: bool,
    timeout: float | None,
) -> None:
    async with AsyncProducer(redis_url, queue=queue, prefix=prefix) as producer:
        handle = await producer.submit(prompt, **fields)
        if stream:
            async with asyncio.timeout(timeout):
                async for event in handle.stream():
                    _print_event(event, as_json)
            return
        result = await handle.result(timeout=timeout)
        typer.echo(result.model_dump_json(indent=2) if as_json else result.text)


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
        async with AsyncProducer(redis_url, queue=queue, prefix=prefix) as producer:
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
        async with AsyncProducer(redis_url, queue=queue, prefix=prefix) as producer:
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
        async with AsyncProducer(redis_url, queue=queue, prefix=prefix) as producer:
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

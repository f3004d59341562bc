"""`exlq dead`: an operator's commands for a queue's dead letters (list, show, replay,
purge). What they send to Redis is dead_letters.py's.

A queue split in partitions is one queue here: every command covers all its partitions.
A dead letter of partition n > 0 shows with the id ``<entry id>#<n>`` (the name `show` and
`replay` take), and `--json` gives each letter's ``partition`` for such a queue; a queue of
one partition prints as it always did."""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Annotated, Any

import redis
import typer
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table

from exlq.ops.dead_letters import (
    DeadLetter,
    DeadLetterError,
    DeadLetters,
    NodeClients,
    NotReplayed,
    Replayed,
    open_dead_letters,
    resolve_queue,
)
from exlq.protocol.keys import DEFAULT_PREFIX
from exlq.protocol.redis_credentials import RedisCredentials

dead_app = typer.Typer(
    name="dead",
    help="A queue's dead letters (jobs that failed for good): list, show, replay, purge.",
    no_args_is_help=True,
)

RedisUrl = Annotated[str, typer.Option("--redis-url", envvar="EXLQ_REDIS_URL", help="Redis to use")]
Prefix = Annotated[str, typer.Option("--prefix", envvar="EXLQ_PREFIX", help="key prefix")]
Queue = Annotated[
    str | None,
    typer.Option(
        "--queue", "-q", envvar="EXLQ_QUEUE", help="queue name (needed when there are several)"
    ),
]
Yes = Annotated[bool, typer.Option("--yes", "-y", help="do it without asking")]
DEFAULT_URL = "redis://localhost:6379/0"
# A replayed job's state lives as long as a submitted one's (the SDK's default).
STATE_TTL_S = 24 * 3600
MESSAGE_WIDTH = 60
REDIS_TIMEOUT_S = 5.0
_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([smhdw]?)\s*$")
_UNIT_S = {"": 1, "s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}


def parse_duration_s(text: str) -> float:
    """``90``, ``90s``, ``15m``, ``2h``, ``7d`` or ``1w`` in seconds; else ValueError."""
    match = _DURATION.fullmatch(text)
    if match is None:
        raise ValueError(
            f"duration {text!r} is not valid: write a number with s, m, h, d or w (e.g. 7d)"
        )
    return float(match.group(1)) * _UNIT_S[match.group(2)]


@contextmanager
def _queue(redis_url: str, prefix: str, queue: str | None) -> Iterator[DeadLetters]:
    """The queue's dead letters, of every partition; any failure on the way is one clear
    error line."""
    client = redis.Redis.from_url(
        redis_url, socket_connect_timeout=REDIS_TIMEOUT_S, socket_timeout=REDIS_TIMEOUT_S
    )
    RedisCredentials().apply_to(client.connection_pool)
    nodes = NodeClients(client)  # on a Redis Cluster, each partition's master
    try:
        keys = resolve_queue(client, prefix, queue)
        yield open_dead_letters(nodes, keys)
    except (DeadLetterError, ValueError) as exc:
        raise _fail(str(exc)) from None
    except (RedisError, OSError) as exc:
        raise _fail(f"Redis: {exc or type(exc).__name__}") from None
    finally:
        nodes.close()
        client.close()


def _fail(message: str) -> typer.Exit:
    typer.secho(f"error: {message}", err=True, fg=typer.colors.RED)
    return typer.Exit(1)


def _when(letter: DeadLetter) -> str:
    at = letter.failed_at
    if at is None:
        return ""
    return datetime.fromtimestamp(at, UTC).strftime("%Y-%m-%d %H:%M:%S")


def _short(text: str, width: int = MESSAGE_WIDTH) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 1] + "…"


def _as_dict(letter: DeadLetter, partitioned: bool) -> dict[str, Any]:
    """The letter's JSON; ``partition`` only for a split queue (one of a single partition
    prints as it always did)."""
    details = {
        "id": letter.name,
        "job_id": letter.job_id,
        "failed_at": letter.failed_at,
        "attempts": letter.attempts,
        "error": letter.error,
        "message": letter.message,
        "lane": letter.lane,
        "entry": letter.job_entry,
        "worker": letter.fields.get("worker"),
    }
    return {**details, "partition": letter.partition} if partitioned else details


def _queue_name(dead: DeadLetters) -> str:
    """The queue, as the summaries name it; a split one says how many partitions it has."""
    name = repr(dead.keys.queue)
    return f"{name} ({dead.partitions} partitions)" if dead.partitions > 1 else name


def _console() -> Console:
    # Piped output is not cut to 80 columns.
    return Console(width=None if sys.stdout.isatty() else 240)


@dead_app.command("list")
def list_(
    queue: Queue = None,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
    count: Annotated[int, typer.Option("--count", "-n", min=1, help="show at most this many")] = 20,
    as_json: Annotated[bool, typer.Option("--json", help="print a JSON array")] = False,
) -> None:
    """List dead letters, newest first."""
    with _queue(redis_url, prefix, queue) as dead:
        letters, total = dead.newest(count), dead.count()
    if as_json:
        partitioned = dead.partitions > 1
        typer.echo(json.dumps([_as_dict(letter, partitioned) for letter in letters], indent=2))
        return
    if not letters:
        typer.echo(f"no dead letters in queue {_queue_name(dead)}")
        return
    table = Table("id", "job id", "failed at (UTC)", "attempts", "error", "message", "lane")
    for letter in letters:
        table.add_row(
            letter.name,
            letter.job_id or "?",
            _when(letter),
            str(letter.attempts),
            letter.error,
            _short(letter.message),
            letter.lane,
        )
    _console().print(table)
    typer.echo(f"{len(letters)} of {total} dead letters in queue {_queue_name(dead)}")


@dead_app.command()
def show(
    ident: Annotated[str, typer.Argument(metavar="ID", help="a dead letter's id, or a job id")],
    queue: Queue = None,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
) -> None:
    """Show one dead letter whole: the error, the attempts and the request."""
    with _queue(redis_url, prefix, queue) as dead:
        letter = dead.find(ident)
    details = _as_dict(letter, dead.partitions > 1)
    shown = ("id", "job_id", "lane", "entry", "attempts", "error", "message", "worker")
    for name in (*shown, "partition"):
        if name in details:  # partition: a split queue's letters only
            typer.echo(f"{name}: {details[name] if details[name] is not None else ''}")
    typer.echo(f"failed_at: {_when(letter)} UTC")
    for name, value in letter.fields.items():
        if name not in ("entry", "job", "error", "message", "attempts", "worker", "failed_at"):
            typer.echo(f"{name}: {value}")
    typer.echo("request:")
    try:
        typer.echo(json.dumps(json.loads(letter.request_json), indent=2, ensure_ascii=False))
    except ValueError:
        typer.echo(letter.request_json)  # refused as it came: not JSON, or cut short


@dead_app.command()
def replay(
    idents: Annotated[
        list[str] | None,
        typer.Argument(metavar="ID...", help="dead letters' ids, or job ids"),
    ] = None,
    replay_all: Annotated[bool, typer.Option("--all", help="every dead letter of the queue")] = (
        False
    ),
    yes: Yes = False,
    queue: Queue = None,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
) -> None:
    """Queue dead letters' jobs again, in their lanes, under their own ids, from attempt 1.
    A job whose request no longer parses is reported, not replayed."""
    if bool(idents) == replay_all:
        raise _fail("name dead letters to replay (ids or job ids), or give --all")
    not_replayed = 0
    with _queue(redis_url, prefix, queue) as dead:
        letters = dead.all() if replay_all else [dead.find(ident) for ident in idents or []]
        if replay_all and not letters:
            typer.echo(f"no dead letters in queue {_queue_name(dead)}")
            return
        if replay_all and not yes:
            typer.confirm(
                f"replay {len(letters)} dead letters of queue {_queue_name(dead)}?", abort=True
            )
        for letter in letters:
            outcome = dead.replay(letter, STATE_TTL_S)
            if isinstance(outcome, Replayed):
                typer.echo(
                    f"replayed job {outcome.job_id}: entry {outcome.entry_id} in lane "
                    f"{outcome.lane}{_of_partition(outcome)}; events on {outcome.channel}"
                )
            else:
                not_replayed += 1
                _report(outcome)
    if not_replayed:
        raise typer.Exit(1)


def _of_partition(outcome: Replayed) -> str:
    """Where a replayed job's entry is, beyond its lane: partition n > 0 of a split queue."""
    return f" of partition {outcome.partition}" if outcome.partition else ""


def _report(outcome: NotReplayed) -> None:
    job = f" (job {outcome.job_id})" if outcome.job_id else ""
    typer.secho(
        f"not replayed: dead letter {outcome.dead_id}{job}: {outcome.reason}",
        err=True,
        fg=typer.colors.YELLOW,
    )


@dead_app.command()
def purge(
    older_than: Annotated[
        str | None,
        typer.Option(
            "--older-than", help="only those written longer ago than this (90s, 15m, 2h, 7d, 1w)"
        ),
    ] = None,
    yes: Yes = False,
    queue: Queue = None,
    redis_url: RedisUrl = DEFAULT_URL,
    prefix: Prefix = DEFAULT_PREFIX,
) -> None:
    """Delete dead letters (all, or those older than --older-than); asks first, unless --yes."""
    try:
        age_s = None if older_than is None else parse_duration_s(older_than)
    except ValueError as exc:
        raise _fail(str(exc)) from None
    with _queue(redis_url, prefix, queue) as dead:
        cutoff_ms = None if age_s is None else dead.now_ms() - int(age_s * 1000)
        count = dead.count_older_than(cutoff_ms)
        which = "" if older_than is None else f" older than {older_than}"
        name = _queue_name(dead)
        if count == 0:
            typer.echo(f"no dead letters{which} in queue {name}")
            return
        if not yes:
            typer.confirm(f"delete {count} dead letters{which} of queue {name}?", abort=True)
        deleted = dead.purge(cutoff_ms)
    typer.echo(f"deleted {deleted} dead letters{which} of queue {name}")

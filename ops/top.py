"""`exlq top`: a live terminal view of queues, workers and recent failures, from Redis alone.

Rates: each worker's heartbeat carries the jobs it ended and the tokens it made per second
over its last heartbeat interval (5 s by default); a queue's rates are its live workers'
sums, so `--once` shows them too. "-": no live worker has sent two heartbeats yet.

A queue split in partitions shows as one queue: its rows sum every partition's
(queue_stats.QueueReader), the row under its name says how many partitions it has, and a
dead letter of partition n > 0 shows as ``<entry id>#<n>`` (as `exlq dead` names it).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from rich.console import Group, RenderableType
from rich.table import Table

from exlq.ops.queue_stats import DeadLetter, QueueReader, QueueStats

RECENT_ERRORS = 5


@dataclass(frozen=True)
class Snapshot:
    """One read of every queue shown, with the newest dead letters of each."""

    queues: tuple[QueueStats, ...]
    dead: tuple[tuple[str, DeadLetter], ...]  # (queue, letter), newest first

    @classmethod
    async def read(cls, reader: QueueReader, queues: Sequence[str]) -> Snapshot:
        stats = await reader.read_many(queues)
        letters = [
            (queue.queue, letter)
            for queue in stats
            if queue.dead_letters
            for letter in await reader.recent_dead_letters(
                queue.queue, RECENT_ERRORS, queue.partitions
            )
        ]
        letters.sort(key=lambda pair: pair[1].failed_at, reverse=True)
        return cls(tuple(stats), tuple(letters[:RECENT_ERRORS]))


def frame(snapshot: Snapshot) -> RenderableType:
    """The three tables of one refresh."""
    return Group(
        _queue_table(snapshot.queues),
        _worker_table(snapshot.queues),
        _error_table(snapshot.dead, _now(snapshot)),
    )


def _queue_table(queues: Iterable[QueueStats]) -> Table:
    table = Table(title="queues", title_justify="left", expand=False)
    columns = ("queue", "lane", "length", "waiting", "pending", "oldest waiting")
    for name in (*columns, "jobs/s", "tokens/s"):
        table.add_column(name, justify="left" if name in ("queue", "lane") else "right")
    for queue in queues:
        for index, lane in enumerate(queue.lanes):
            waiting = f"{lane.waiting:,}" if lane.waiting_exact else f"<={lane.waiting:,}"
            first = index == 0  # the queue's name and rates, on its first lane's row
            table.add_row(
                _queue_cell(queue, index),
                lane.lane,
                f"{lane.length:,}",
                waiting,
                f"{lane.pending:,}",
                _duration(lane.oldest_waiting_s),
                _rate(queue.jobs_per_s, ".1f") if first else "",
                _rate(queue.tokens_per_s, ",.0f") if first else "",
            )
    return table


def _queue_cell(queue: QueueStats, row: int) -> str:
    """The queue column of a queue's ``row``-th lane row: its name, then (split queues) how
    many partitions its numbers sum."""
    if row == 0:
        return queue.queue
    return f"{queue.partitions} partitions" if row == 1 and queue.partitions > 1 else ""


def _worker_table(queues: Iterable[QueueStats]) -> Table:
    table = Table(title="workers", title_justify="left")
    left = ("worker", "queue", "model", "engine")
    for name in (*left, "load", "tokens/s", "last seen"):
        table.add_column(name, justify="left" if name in left else "right")
    for queue in queues:
        for worker in queue.workers:
            table.add_row(
                worker.name,
                queue.queue,
                worker.model or "-",
                worker.engine + ("" if worker.ready else " (loading)"),
                f"{worker.load}/{worker.capacity}",
                _rate(worker.tokens_per_s, ",.0f"),
                f"{_duration(queue.redis_time_s - worker.last_seen)} ago",
            )
    return table


def _rate(rate: float | None, spec: str) -> str:
    return "-" if rate is None else format(rate, spec)


def _error_table(dead: Iterable[tuple[str, DeadLetter]], now_s: float) -> Table:
    table = Table(title="recent dead letters", title_justify="left")
    for name in ("queue", "entry", "error", "message", "when"):
        table.add_column(name, justify="right" if name == "when" else "left")
    for queue, letter in dead:
        table.add_row(
            queue,
            letter.name,
            letter.error,
            letter.message[:60],
            f"{_duration(now_s - letter.failed_at)} ago",
        )
    return table


def _now(snapshot: Snapshot) -> float:
    return max((queue.redis_time_s for queue in snapshot.queues), default=time.time())


def _duration(seconds: float) -> str:
    seconds = max(seconds, 0.0)
    if seconds < 60:
        return f"{seconds:.1f}s"
    if seconds < 3600:
        return f"{seconds // 60:.0f}m{seconds % 60:02.0f}s"
    return f"{seconds // 3600:.0f}h{seconds % 3600 // 60:02.0f}m"


async def watch(reader: QueueReader, named: Sequence[str], interval_s: float, once: bool) -> None:
    """Print one frame (``once``) or refresh one in place every ``interval_s``."""
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not console.is_terminal:  # a pipe or a file: no ANSI, and room for the tables
        console.width = max(console.width, 140)

    async def next_frame() -> RenderableType:
        queues = list(named) or await reader.discover()
        snapshot = await Snapshot.read(reader, queues)
        return frame(snapshot)

    if once:
        console.print(await next_frame())
        return
    with Live(await next_frame(), console=console, auto_refresh=False) as live:
        while True:
            await asyncio.sleep(interval_s)
            live.update(await next_frame(), refresh=True)

"""`exlq top`: a live terminal view of queues, workers and recent failures, from Redis alone.

Rates: Redis keeps no count of finished jobs or of tokens (results are per-job keys, and a
worker's counters are in its own /metrics). Redis 7 keeps, per consumer group, the entries
ever read (XINFO GROUPS ``entries-read``); read minus pending is the entries finished (done,
failed or dead-lettered), and its change between two reads is the jobs/s shown. Redis 6.2
has no such count: there jobs/s shows "-". Tokens/s is not shown: no key holds a count.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

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
            for letter in await reader.recent_dead_letters(queue.queue, RECENT_ERRORS)
        ]
        letters.sort(key=lambda pair: pair[1].failed_at, reverse=True)
        return cls(tuple(stats), tuple(letters[:RECENT_ERRORS]))


@dataclass
class JobRates:
    """Jobs finished per second per queue, from two successive snapshots (Redis >= 7)."""

    _last: dict[str, tuple[int, float]] = field(default_factory=dict)

    def update(self, snapshot: Snapshot) -> dict[str, float | None]:
        rates: dict[str, float | None] = {}
        for queue in snapshot.queues:
            finished = _finished(queue)
            before = self._last.get(queue.queue)
            rates[queue.queue] = None
            if finished is None:
                self._last.pop(queue.queue, None)
                continue
            if before is not None and queue.redis_time_s > before[1]:
                done = max(finished - before[0], 0)
                rates[queue.queue] = done / (queue.redis_time_s - before[1])
            self._last[queue.queue] = (finished, queue.redis_time_s)
        return rates


def frame(snapshot: Snapshot, rates: dict[str, float | None]) -> RenderableType:
    """The three tables of one refresh."""
    return Group(
        _queue_table(snapshot.queues, rates),
        _worker_table(snapshot.queues),
        _error_table(snapshot.dead, _now(snapshot)),
    )


def _queue_table(queues: Iterable[QueueStats], rates: dict[str, float | None]) -> Table:
    table = Table(title="queues", title_justify="left", expand=False)
    for name in ("queue", "lane", "length", "waiting", "pending", "oldest waiting", "jobs/s"):
        table.add_column(name, justify="left" if name in ("queue", "lane") else "right")
    for queue in queues:
        rate = rates.get(queue.queue)
        for index, lane in enumerate(queue.lanes):
            waiting = f"{lane.waiting:,}" if lane.waiting_exact else f"<={lane.waiting:,}"
            table.add_row(
                queue.queue if index == 0 else "",
                lane.lane,
                f"{lane.length:,}",
                waiting,
                f"{lane.pending:,}",
                _duration(lane.oldest_waiting_s),
                ("-" if rate is None else f"{rate:.1f}") if index == 0 else "",
            )
    return table


def _worker_table(queues: Iterable[QueueStats]) -> Table:
    table = Table(title="workers", title_justify="left")
    for name in ("worker", "queue", "model", "engine", "load", "last seen"):
        table.add_column(name, justify="right" if name in ("load", "last seen") else "left")
    for queue in queues:
        for worker in queue.workers:
            table.add_row(
                worker.name,
                queue.queue,
                worker.model or "-",
                worker.engine + ("" if worker.ready else " (loading)"),
                f"{worker.load}/{worker.capacity}",
                f"{_duration(queue.redis_time_s - worker.last_seen)} ago",
            )
    return table


def _error_table(dead: Iterable[tuple[str, DeadLetter]], now_s: float) -> Table:
    table = Table(title="recent dead letters", title_justify="left")
    for name in ("queue", "entry", "error", "message", "when"):
        table.add_column(name, justify="right" if name == "when" else "left")
    for queue, letter in dead:
        table.add_row(
            queue,
            letter.entry_id,
            letter.error,
            letter.message[:60],
            f"{_duration(now_s - letter.failed_at)} ago",
        )
    return table


def _finished(queue: QueueStats) -> int | None:
    counts = [lane.finished for lane in queue.lanes if lane.has_group]
    if not counts or any(count is None for count in counts):
        return None
    return sum(count for count in counts if count is not None)


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
    rates = JobRates()

    async def next_frame() -> RenderableType:
        queues = list(named) or await reader.discover()
        snapshot = await Snapshot.read(reader, queues)
        return frame(snapshot, rates.update(snapshot))

    if once:
        console.print(await next_frame())
        return
    with Live(await next_frame(), console=console, auto_refresh=False) as live:
        while True:
            await asyncio.sleep(interval_s)
            live.update(await next_frame(), refresh=True)

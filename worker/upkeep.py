"""Upkeep: a worker's periodic duties: claims, reclaiming, deadlines, cancels, heartbeat, trim."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from redis.exceptions import RedisError

from exlq.protocol.models import FinishReason
from exlq.worker.broker import Broker
from exlq.worker.engine_loop import EngineRunner
from exlq.worker.job_state import HELD, LOST, RUNNING, JobBook
from exlq.worker.partitions import follow_count
from exlq.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

TICK_S = 0.1
CANCEL_POLL_S = 1.0
CONSUMER_FORGET_AFTER_S = 3600.0


class Served(Protocol):
    """What upkeep needs of the worker it keeps (runner.Worker)."""

    settings: WorkerSettings
    broker: Broker
    engine: EngineRunner
    jobs: JobBook
    capacity: int
    closing: asyncio.Event
    clock_offset_s: float
    jobs_ended: int  # since the worker started
    tokens_generated: int

    @property
    def ready(self) -> bool: ...

    def set_redis_ok(self, ok: bool) -> None: ...

    async def reclaim(self) -> None: ...

    def cancel(self, job_id: str, reason: FinishReason | None = None) -> None: ...

    async def entries_lost(self, unwritten: list[tuple[str, str]]) -> None: ...


_RUNNING = frozenset({RUNNING})
_RENEWED = HELD - {LOST}


@dataclass
class _Every:
    """A duty and how often it runs."""

    seconds: float
    duty: Callable[[], Awaitable[None]]
    due_at: float = 0.0


@dataclass
class _Rates:
    """Jobs ended and tokens made per second since the last heartbeat, which carries them
    for `exlq top` (a worker's own counters are on its /metrics, which top does not read);
    none in the first heartbeat."""

    at: float | None = None
    jobs: int = 0
    tokens: int = 0

    def since_last(self, jobs: int, tokens: int) -> dict[str, float]:
        now, before = time.monotonic(), self.at
        rates: dict[str, float] = {}
        if before is not None and now > before:
            rates = {
                "jobs_per_s": round((jobs - self.jobs) / (now - before), 3),
                "tokens_per_s": round((tokens - self.tokens) / (now - before), 1),
            }
        self.at, self.jobs, self.tokens = now, jobs, tokens
        return rates


class Upkeep:
    def __init__(self, worker: Served) -> None:
        self.worker = worker
        self._rates = _Rates()
        settings = worker.settings.broker
        self._duties = [
            _Every(settings.claim_renew_seconds, self.renew_claims),
            _Every(max(settings.claim_idle_ms / 1000 / 2, TICK_S), worker.reclaim),
            _Every(CANCEL_POLL_S, self.poll_cancels),
            _Every(settings.heartbeat_seconds, self.heartbeat),
            _Every(settings.heartbeat_seconds, self.follow_partitions),
            _Every(settings.trim_interval_seconds, self.trim),
        ]

    async def run(self) -> None:
        while not self.worker.closing.is_set():
            now = time.monotonic()
            self.expire_overdue()
            for every in self._duties:
                if now >= every.due_at:
                    every.due_at = now + every.seconds
                    await self._guarded(every.duty)
            await asyncio.sleep(TICK_S)

    async def _guarded(self, duty: Callable[[], Awaitable[None]]) -> None:
        # Readiness is the read loop's and the commits' to say: a duty that works while
        # reads fail (a heartbeat while the queue's group is gone) must not make the worker
        # look ready, and one that fails while reads work is a warning, not an outage.
        try:
            await duty()
        except RedisError as exc:
            log.warning("%s failed: %s", duty.__name__, exc)

    def expire_overdue(self) -> None:
        now = time.time()
        for job in self.worker.jobs.jobs_in(_RUNNING):
            if job.request.past_deadline(now):
                self.worker.cancel(job.job_id, reason="expired")

    async def renew_claims(self) -> None:
        """Keep the entries this worker runs from looking abandoned, however long they run."""
        jobs = self.worker.jobs.jobs_in(_RENEWED)
        sent_at = time.time()
        lost = await self.worker.broker.renew([(job.job_id, job.entry_id) for job in jobs])
        kept = {entry for entry, _ in lost}
        for job in jobs:
            if job.entry_id not in kept:
                job.claimed_at = sent_at
        if lost:
            await self.worker.entries_lost(lost)

    async def poll_cancels(self) -> None:
        """Cancellation flags, in case the pub/sub message was missed."""
        running = [(job.job_id, job.entry_id) for job in self.worker.jobs.jobs_in(_RUNNING)]
        for job_id in await self.worker.broker.cancel_flags(running):
            self.worker.cancel(job_id)

    async def heartbeat(self) -> None:
        worker = self.worker
        model = worker.settings.serving.model
        await worker.broker.heartbeat(
            {
                "engine": worker.engine.name,
                "model": model.name if model else None,
                "capacity": worker.capacity,
                "load": worker.jobs.held,
                "ready": worker.ready,
                **self._rates.since_last(worker.jobs_ended, worker.tokens_generated),
            },
            stale_after_s=worker.settings.broker.heartbeat_seconds * 6,
        )
        # Clocks drift: the offset times jobs from their entry ids, and bounds the lease of
        # the worker's claims in Redis time (runner.Worker._lease_until_ms).
        worker.clock_offset_s = await worker.broker.clock_offset_s()

    async def follow_partitions(self) -> None:
        """Read the partitions another worker's higher EXLQ_PARTITIONS added."""
        self.worker.broker = await follow_count(self.worker.broker)

    async def trim(self) -> None:
        """Bounded memory: drop entries every group has finished, and consumers long gone."""
        trimmed = await self.worker.broker.trim()
        idle_ms = self.worker.settings.broker.claim_idle_ms
        forgotten = await self.worker.broker.forget_idle_consumers(
            int(max(CONSUMER_FORGET_AFTER_S, idle_ms / 100) * 1000)
        )
        if trimmed or forgotten:
            log.debug("trimmed %d entries, forgot %d idle consumers", trimmed, forgotten)

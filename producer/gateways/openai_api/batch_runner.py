"""BatchRunner: every gateway replica runs one; it drives the open batches a step at a time.
A replica works on a batch only while it holds the batch's lease (SET NX PX, renewed each
step); a replica that dies stops renewing, and another takes the batch over once the lease
lapses. Every step reads its state from Redis and writes it back idempotently, so a
takeover redoes at most one step."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import socket
import time
from collections.abc import Callable

from redis.exceptions import RedisError

from exlq.producer.gateways.openai_api.batch_collect import collect
from exlq.producer.gateways.openai_api.batch_finalize import finalize, stop_jobs
from exlq.producer.gateways.openai_api.batch_settings import BatchSettings
from exlq.producer.gateways.openai_api.batch_store import ENDING, BatchStore
from exlq.producer.gateways.openai_api.batch_submit import submit_more
from exlq.producer.gateways.openai_api.batch_validate import validate
from exlq.producer.gateways.openai_api.batch_work import Batch, BatchWork
from exlq.producer.gateways.openai_api.file_store import FileStore
from exlq.producer.gateways.openai_api.producers import ProducerPool

log = logging.getLogger(__name__)

# How long stop() lets a step in progress end before cancelling it.
STOP_WAIT_S = 5.0
_TERMINAL = frozenset({"completed", "failed", "expired", "cancelled"})
# KEYS[1] the lease; ARGV[1] this runner's token, ARGV[2] the lease in ms. Takes a free
# lease or renews this runner's own; 0 while another runner holds it.
_LEASE_LUA = """
local holder = redis.call('GET', KEYS[1])
if holder == false then
  redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2])
  return 1
end
if holder == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""
_RELEASE_LUA = """
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
"""


class BatchRunner:
    """Drives batches until stopped: ``await runner.start()`` ... ``await runner.stop()``,
    or ``async with BatchRunner(pool, settings):``."""

    def __init__(
        self,
        pool: ProducerPool,
        settings: BatchSettings,
        *,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.work = BatchWork(
            pool=pool,
            store=BatchStore(pool.batch_redis, pool.batch_prefix),
            files=FileStore(pool.batch_redis, pool.batch_prefix),
            settings=settings,
            clock=clock,
        )
        # Says which replica holds a lease, for an operator reading Redis.
        self.token = f"{socket.gethostname()}:{secrets.token_hex(6)}"
        self._lease = pool.batch_redis.register_script(_LEASE_LUA)
        self._release = pool.batch_redis.register_script(_RELEASE_LUA)
        self._held: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def __aenter__(self) -> BatchRunner:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def start(self) -> None:
        if self._task is None:
            self._stopping.clear()
            self._task = asyncio.create_task(self._run(), name="exlq-batch-runner")

    async def stop(self) -> None:
        """Lets the step in progress end (for at most STOP_WAIT_S, then cancels it), and
        gives back the leases held, so that another replica goes on at once."""
        task, self._task = self._task, None
        self._stopping.set()
        if task is not None:
            await _end(task)
        for batch_id in sorted(self._held):
            with contextlib.suppress(RedisError, OSError):
                await self._release(keys=[self.work.store.keys.lease(batch_id)], args=[self.token])
        self._held.clear()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            try:
                await self.run_once()
            except (RedisError, OSError) as exc:
                log.warning("batch runner: Redis is unavailable (%s); trying again", exc)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.work.settings.poll_interval_s):
                    await self._stopping.wait()

    async def run_once(self) -> None:
        """One step of every open batch whose lease this runner holds or can take."""
        for batch_id in await self.work.store.open_ids():
            if self._stopping.is_set():
                return
            if not await self._take_lease(batch_id):
                continue
            try:
                await self._step(batch_id)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError):
                raise
            except Exception:
                # A bug in one batch's step must not stop the others; the step runs again.
                log.exception("batch %s: a step failed", batch_id)

    async def _take_lease(self, batch_id: str) -> bool:
        held = await self._lease(
            keys=[self.work.store.keys.lease(batch_id)],
            args=[self.token, self.work.settings.lease_ms],
        )
        if held:
            self._held.add(batch_id)
        else:
            self._held.discard(batch_id)
        return bool(held)

    async def _step(self, batch_id: str) -> None:
        fields = await self.work.store.fields(batch_id)
        if fields is None or fields["status"] in _TERMINAL:
            await self.work.store.close(batch_id)
            self._held.discard(batch_id)
            return
        batch = Batch.from_fields(fields)
        if batch.ending is not None:
            await finalize(self.work, batch)
        elif batch.status == "validating":
            await validate(self.work, batch)
        elif batch.status == "cancelling":
            await stop_jobs(self.work, batch, "cancelled")
        elif batch.status == "in_progress":
            await self._advance(batch)

    async def _advance(self, batch: Batch) -> None:
        work = self.work
        if work.now() >= batch.expires_at:
            await stop_jobs(work, batch, "expired")
            return
        in_flight = await collect(work, batch, resubmit_lost=True)
        await submit_more(work, batch, in_flight)
        store, keys = work.store, work.store.keys
        completed = await store.redis.hlen(keys.output(batch.id))
        failed = await store.redis.hlen(keys.errors(batch.id))
        counts = {"total": batch.total, "completed": completed, "failed": failed}
        await store.set_if_status(batch.id, "in_progress", {"request_counts": counts})
        if completed + failed + await store.redis.hlen(keys.stopped(batch.id)) >= batch.total:
            now = work.now()
            ended = {"status": "finalizing", "finalizing_at": now, ENDING: "completed"}
            await store.set_if_status(batch.id, "in_progress", ended)


async def _end(task: asyncio.Task[None]) -> None:
    """Waits for the runner's task; cancels it if its step takes too long. A cancel can be
    lost inside a library's own wait (Python 3.11's gather and wait_for have such races), so
    it is sent again until the task has ended."""
    done, _ = await asyncio.wait([task], timeout=STOP_WAIT_S)
    while not done:
        task.cancel()
        done, _ = await asyncio.wait([task], timeout=1.0)
    if not task.cancelled() and task.exception() is not None:
        log.error("the batch runner had failed", exc_info=task.exception())

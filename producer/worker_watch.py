"""WorkerWatch: does a live worker serve the queue? Read from the workers' heartbeats.

Every worker writes a heartbeat into the queue's workers hash every few seconds (its id,
engine, load and the time it was last seen; worker/upkeep.py). A job sent to a queue that
no worker serves would wait in silence, so a handle whose job has not started after a few
seconds asks here. A submit never does: it costs no round trip for this, and a worker
that starts just after the submit (before its first heartbeat) is no cause for alarm.
Handles that ask at once share one read, and an answer "served" holds for CACHE_S.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from exlq.protocol.heartbeat import live_times
from exlq.protocol.keys import QueueKeys

log = logging.getLogger(__name__)

# A worker sends a heartbeat every 5 s by default and counts one silent for 6 of those as
# gone (worker/upkeep.py): the same here, for workers on their default settings.
DEFAULT_STALE_AFTER_S = 30.0
# How long an answer "served" holds before the heartbeats are read again. "Not served" is
# not held: the next question reads again, so a worker that has just started is seen.
CACHE_S = 5.0


class WorkerWatch:
    """Whether a live worker serves one queue; one read of the heartbeats at a time."""

    def __init__(
        self,
        client: aioredis.Redis,
        keys: QueueKeys,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        wait_for_worker: bool = False,
    ) -> None:
        self._client = client
        self.keys = keys
        self.stale_after_s = stale_after_s
        self.wait_for_worker = wait_for_worker
        self._served_until = -math.inf  # the monotonic time an answer "served" holds until
        self._reading: asyncio.Task[bool] | None = None
        self._warned = False  # in the stretch without workers going on now

    async def served(self) -> bool:
        """Whether a worker sent a heartbeat within ``stale_after_s``. True where the
        heartbeats cannot be read (an ACL without their key): nothing can be said, so
        nothing is refused. Raises Redis's connection errors."""
        if time.monotonic() < self._served_until:
            return True
        task = self._reading
        if task is None or task.done():
            task = self._reading = asyncio.ensure_future(self._read())
            task.add_done_callback(_retrieve)  # read even when every caller has gone
        # Shared by every handle that asks meanwhile; one that is cancelled leaves it be.
        return await asyncio.shield(task)

    def warn_waiting(self, job_id: str) -> None:
        """Say, once per stretch without workers, that jobs wait for one."""
        if not self._warned:
            self._warned = True
            log.warning(
                "job %s waits: no live worker serves queue %r (none sent a heartbeat in the "
                "last %gs); jobs stay queued until one starts",
                job_id,
                self.keys.queue,
                self.stale_after_s,
            )

    async def _read(self) -> bool:
        try:
            heartbeats = cast("dict[Any, Any]", await self._client.hgetall(self.keys.workers))
        except ResponseError as exc:  # NOPERM (an ACL without the key), or not a hash
            log.warning(
                "cannot read the workers' heartbeats (%s), so a job's wait for a worker of "
                "queue %r is not checked; %s",
                exc,
                self.keys.queue,
                f"grant this Redis user read access to {self.keys.workers}"
                if isinstance(exc, NoPermissionError)
                else "this exlq may be older than the queue's workers",
            )
            self._served_until = math.inf  # never asked again
            return True
        served = bool(live_times(heartbeats.values(), self.stale_after_s, time.time()))
        if served:
            self._served_until = time.monotonic() + CACHE_S
            self._warned = False
        return served

    async def close(self) -> None:
        task, self._reading = self._reading, None
        if task is None or task.done():
            return
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            current = asyncio.current_task()
            if current is not None and current.cancelling():
                raise  # this close was cancelled too: that one is not ours to swallow


def _retrieve(task: asyncio.Task[bool]) -> None:
    if not task.cancelled():
        task.exception()

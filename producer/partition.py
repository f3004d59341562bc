"""QueuePartition: one partition of a queue as a producer reaches it.

A queue of one partition has one; a queue split in partitions (docs/SCALING.md) has one per
partition, each with a client that reaches its slot's node and, where job events go on
shard channels (a Redis Cluster), an event connection of its own on that node. Everything
the producer does for a job (submit, cancel, status, result) goes to the job's partition.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass
from typing import cast

import redis.asyncio as aioredis

from exlq.producer.submit_batch import Replicas, SubmitBatcher
from exlq.producer.subscriber import EventRouter
from exlq.protocol.keys import LANES, QueueKeys
from exlq.protocol.models import JobResult

# The job whose channel and state key the producer's event connection tries once, at
# connect: may its Redis user subscribe to job channels, and does the server run commands
# on a subscribed connection? Nothing is written.
SERVER_CHECK_ID = "exlq-server-check"

# Mark the job so a worker that has not started it never will, and tell running workers.
_CANCEL_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if not state then return '' end
if state == 'queued' or state == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call('PUBLISH', ARGV[1], ARGV[2])
end
return state
"""
# The job has not started and no worker serves its queue: mark it, so that a worker that
# starts later skips it, the way a cancel does.
_CANCEL_QUEUED_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'queued' then redis.call('HSET', KEYS[1], 'cancel', '1') end
return state or ''
"""


@dataclass(frozen=True)
class JobStatus:
    id: str
    state: str
    attempts: int
    worker: str | None


def router_for(client: aioredis.Redis, keys: QueueKeys) -> EventRouter:
    """An event connection for the jobs of ``keys``' partition."""
    return EventRouter(
        client,
        keys.events(SERVER_CHECK_ID),
        keys.job(SERVER_CHECK_ID),
        keys.shard_events(SERVER_CHECK_ID),
    )


class QueuePartition:
    """The keys, client, event connection and submit batchers of one partition."""

    def __init__(
        self,
        client: aioredis.Redis,
        router: EventRouter,
        keys: QueueKeys,
        state_ttl_s: int,
        max_backlog: int,
        replicas: Replicas | None = None,
    ) -> None:
        self.client = client
        self.router = router
        self.keys = keys
        self.submits = {
            lane: SubmitBatcher(client, router, keys, state_ttl_s, max_backlog, lane, replicas)
            for lane in LANES
        }
        self._cancel_script = client.register_script(_CANCEL_LUA)
        self._cancel_queued_script = client.register_script(_CANCEL_QUEUED_LUA)

    async def close(self) -> None:
        for submits in self.submits.values():
            await submits.close()

    async def get_result(self, job_id: str) -> JobResult | None:
        raw = await self.client.get(self.keys.result(job_id))
        return None if raw is None else JobResult.model_validate_json(raw)

    async def result_and_state(self, job_id: str) -> tuple[JobResult | None, bool]:
        """The stored result and whether the job's state hash exists, in one round trip.
        No MULTI: the state exists from the submit until it expires, and the result is
        written with the state's end, so no interleaving shows a job Redis holds as one
        with neither."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(self.keys.result(job_id))
        pipe.exists(self.keys.job(job_id))
        raw, state_count = await pipe.execute()
        result = None if raw is None else JobResult.model_validate_json(raw)
        return result, bool(state_count)

    async def status(self, job_id: str) -> JobStatus | None:
        fields = cast("dict[bytes, bytes]", await self.client.hgetall(self.keys.job(job_id)))
        if not fields:
            return None
        text = {k.decode(): v.decode() for k, v in fields.items()}
        return JobStatus(
            id=job_id,
            state=text.get("state", "unknown"),
            attempts=int(text.get("attempts", "0")),
            worker=text.get("worker"),
        )

    async def cancel(self, job_id: str) -> str:
        """Ask for the job to stop. Returns the state it had ('' if unknown here)."""
        state = await self._cancel_script(
            keys=[self.keys.job(job_id)], args=[self.keys.cancel, job_id]
        )
        return state.decode() if isinstance(state, bytes) else str(state)

    async def cancel_if_queued(self, job_id: str) -> str:
        """Cancel the job only if no worker has started it; returns the state it had."""
        state = await self._cancel_queued_script(keys=[self.keys.job(job_id)])
        return state.decode() if isinstance(state, bytes) else str(state)

    async def release(self, job_id: str, events: asyncio.Queue[bytes]) -> None:
        with contextlib.suppress(Exception):
            channel = self.keys.channel(job_id, self.router.version)
            await self.router.unsubscribe_many([(channel, events)])

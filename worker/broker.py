"""Broker: every Redis command the worker sends, behind one small API."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer.keys import CONSUMER_GROUP, QueueKeys

# Runs when a worker takes an entry: skip jobs that ended or were cancelled, count the
# attempt and record who runs it, atomically so two entries of one id never both run.
_START_LUA = """
local state = redis.call('HGET', KEYS[1], 'state')
if state == 'done' or state == 'failed' or state == 'cancelled' or state == 'expired' then
  return {'ended', state}
end
local entry = redis.call('HGET', KEYS[1], 'entry')
if entry and entry ~= ARGV[3] then return {'duplicate', entry} end
if redis.call('HGET', KEYS[1], 'cancel') == '1' then return {'cancel', '0'} end
local attempts = redis.call('HINCRBY', KEYS[1], 'attempts', 1)
redis.call('HSET', KEYS[1], 'state', 'running', 'worker', ARGV[1], 'entry', ARGV[3])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {'run', tostring(attempts)}
"""


@dataclass(frozen=True, slots=True)
class StreamEntry:
    entry_id: str
    payload: bytes | None  # the ``job`` field; None when the entry has none

    @property
    def enqueued_at_server(self) -> float:
        """Unix time (Redis server clock) at which XADD created the entry."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0


@dataclass(frozen=True, slots=True)
class StartDecision:
    verdict: str  # run | cancel | ended | duplicate
    detail: str

    @property
    def attempt(self) -> int:
        return int(self.detail) if self.verdict == "run" else 0


@dataclass
class Batch:
    """Writes gathered from one or more engine steps, sent in one MULTI/EXEC.

    Order inside matters for at-least-once delivery: the result and the final event are
    written before the entry is acknowledged, in the same transaction."""

    publishes: list[tuple[str, str]] = field(default_factory=list)
    results: list[tuple[str, str, str, str]] = field(default_factory=list)
    dead: list[dict[str, str]] = field(default_factory=list)
    acks: list[str] = field(default_factory=list)

    def publish(self, channel: str, event_json: str) -> None:
        self.publishes.append((channel, event_json))

    def store_result(self, job_id: str, state: str, result_json: str, worker: str) -> None:
        self.results.append((job_id, state, result_json, worker))

    def dead_letter(self, fields: dict[str, str]) -> None:
        self.dead.append(fields)

    def ack(self, entry_id: str) -> None:
        self.acks.append(entry_id)

    def __len__(self) -> int:
        return len(self.publishes) + len(self.results) + len(self.dead) + len(self.acks)


class Broker:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: QueueKeys,
        consumer: str,
        *,
        result_ttl_s: int,
        dead_max_len: int,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.dead_max_len = dead_max_len
        self._start = client.register_script(_START_LUA)

    @classmethod
    def from_url(cls, url: str, keys: QueueKeys, consumer: str, **options: Any) -> Broker:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=15)
        return cls(client, keys, consumer, **options)

    async def close(self) -> None:
        await self.client.aclose()

    async def ping(self) -> None:
        await self.client.ping()

    async def clock_offset_s(self) -> float:
        """Redis server clock minus this host's clock, to time jobs from their entry ids."""
        before = time.time()
        seconds, micros = await self.client.time()
        after = time.time()
        return seconds + micros / 1e6 - (before + after) / 2

    async def ensure_group(self) -> None:
        try:
            await self.client.xgroup_create(self.keys.jobs, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int) -> list[StreamEntry]:
        # RESP2 replies (the client's default): [(stream, [(entry_id, fields), ...])]
        reply = cast(
            "list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None",
            await self.client.xreadgroup(
                CONSUMER_GROUP, self.consumer, {self.keys.jobs: ">"}, count=count, block=block_ms
            ),
        )
        entries: list[StreamEntry] = []
        for _stream, messages in reply or []:
            for entry_id, fields in messages:
                entries.append(StreamEntry(entry_id.decode(), fields.get(b"job")))
        return entries

    async def start_jobs(self, starts: list[tuple[str, str]]) -> list[StartDecision]:
        """For each (job_id, entry_id), decide whether to run it and count the attempt."""
        pipe = self.client.pipeline(transaction=False)
        for job_id, entry_id in starts:
            await self._start(
                keys=[self.keys.job(job_id)],
                args=[self.consumer, self.result_ttl_s, entry_id],
                client=pipe,
            )
        replies = await pipe.execute()
        return [StartDecision(verdict.decode(), detail.decode()) for verdict, detail in replies]

    async def commit(self, batch: Batch) -> None:
        pipe = self.client.pipeline(transaction=True)
        for job_id, state, result_json, worker in batch.results:
            pipe.set(self.keys.result(job_id), result_json, ex=self.result_ttl_s)
            pipe.hset(self.keys.job(job_id), mapping={"state": state, "worker": worker})
            pipe.expire(self.keys.job(job_id), self.result_ttl_s)
        for channel, event_json in batch.publishes:
            pipe.publish(channel, event_json)
        for fields in batch.dead:
            pipe.xadd(self.keys.dead, fields, maxlen=self.dead_max_len, approximate=True)  # type: ignore[arg-type]
        if batch.acks:
            pipe.xack(self.keys.jobs, CONSUMER_GROUP, *batch.acks)
        await pipe.execute()

    async def cancel_requests(self) -> AsyncIterator[str]:
        """Job ids as cancellation requests arrive on the queue's cancel channel."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.cancel)
        try:
            async for message in pubsub.listen():
                data = message.get("data")
                if isinstance(data, bytes):
                    yield data.decode(errors="replace")
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def heartbeat(self, info: dict[str, Any], stale_after_s: float) -> None:
        now = time.time()
        info = {**info, "last_seen": now}
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.workers, self.consumer, json.dumps(info))
        pipe.expire(self.keys.workers, max(int(stale_after_s * 10), 60))
        pipe.hgetall(self.keys.workers)
        *_, workers = await pipe.execute()
        stale = [name for name, raw in workers.items() if _last_seen(raw) < now - stale_after_s]
        if stale:
            await self.client.hdel(self.keys.workers, *stale)

    async def leave(self) -> None:
        await self.client.hdel(self.keys.workers, self.consumer)

    async def pending_count(self) -> int:
        """Entries this consumer holds, as Redis sees them."""
        reply = await self.client.xpending_range(
            self.keys.jobs,
            CONSUMER_GROUP,
            min="-",
            max="+",
            count=100_000,
            consumername=self.consumer,
        )
        return len(reply)


def _last_seen(raw: bytes) -> float:
    try:
        return float(json.loads(raw).get("last_seen", 0.0))
    except (ValueError, AttributeError):
        return 0.0

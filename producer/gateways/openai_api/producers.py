"""One SDK producer per model: a model name is a queue name. Shared by every route."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from exlq.producer.client import AsyncProducer
from exlq.protocol.command_packing import pack_in_c
from exlq.protocol.heartbeat import live_times
from exlq.protocol.keys import QueueKeys, check_name
from exlq.protocol.redis_credentials import RedisCredentials
from exlq.protocol.slot_routing import SlotClients, cluster_masters

# The hash tag of the Batch API's keys on a Redis Cluster (no queue name has its braces'
# neighbours; a queue of this name would only share its slot).
BATCH_API_TAG = "openai-batch-api"


@dataclass(frozen=True, slots=True)
class LiveModel:
    """A queue with at least one live worker, from the workers' heartbeats."""

    name: str
    workers: int
    created: int  # the Unix time the oldest live worker started, or its last heartbeat


class ProducerPool:
    """Creates each queue's AsyncProducer on first use; all share one connection pool."""

    def __init__(
        self,
        redis_url: str,
        *,
        prefix: str,
        worker_stale_after_s: float,
        max_backlog: int = 0,
        max_connections: int = 64,
        credentials: RedisCredentials | None = None,
    ) -> None:
        pool = aioredis.BlockingConnectionPool.from_url(
            redis_url, max_connections=max_connections, timeout=None
        )
        if credentials is not None:
            credentials.apply_to(pool)
        pack_in_c(pool)
        self.redis = aioredis.Redis(connection_pool=pool)
        # Each queue's client: on a Redis Cluster, one reaching the queue's master.
        self.clients = SlotClients(self.redis)
        self.prefix = prefix
        # The Batch API's client and key prefix (files, batches): on a Redis Cluster, under
        # one hash tag, so that one master holds them all (place_batch_api).
        self.batch_redis = self.redis
        self.batch_prefix = prefix
        self.worker_stale_after_s = worker_stale_after_s
        self.max_backlog = max_backlog
        self._producers: dict[str, AsyncProducer] = {}

    def producer(self, model: str) -> AsyncProducer:
        """The producer of queue ``model``; raises ValueError for a name no queue can have."""
        found = self._producers.get(model)
        if found is None:
            check_name("model", model)
            found = AsyncProducer(
                queue=model,
                prefix=self.prefix,
                client=self.clients.following(self.keys(model).jobs),
                max_backlog=self.max_backlog,
                worker_stale_after_s=self.worker_stale_after_s,
            )
            self._producers[model] = found
        return found

    async def place_batch_api(self) -> None:
        """On a Redis Cluster, put the Batch API's keys under the hash tag BATCH_API_TAG
        (``P:{openai-batch-api}:files``, ``...:batch:{id}``, ...): its scripts and MULTIs
        span a batch, its files and their indexes, which must share a slot. On one Redis
        the keys keep their names (``P:files``, ``P:batch:{id}``, ...). A Redis not
        answering at start is taken for a single one."""
        try:
            masters = await cluster_masters(self.redis.connection_pool)
        except (RedisError, OSError):
            return
        if masters is not None:
            self.batch_prefix = f"{self.prefix}:{{{BATCH_API_TAG}}}"
            self.batch_redis = self.clients.following(f"{self.batch_prefix}:batches")

    def keys(self, model: str) -> QueueKeys:
        return QueueKeys(queue=model, prefix=self.prefix)

    async def live_models(self) -> list[LiveModel]:
        """Every queue under the prefix whose workers hash holds a live heartbeat."""
        found: list[LiveModel] = []
        async for key in self.clients.scan_iter(match=f"{self.prefix}:{{*}}:workers", count=500):
            name = _queue_of(key, self.prefix)
            if name is None:
                continue
            client = await self.clients.for_key(self.keys(name).workers)
            live = self._live(name, await client.hvals(key))
            if live is not None:
                found.append(live)
        return sorted(found, key=lambda m: m.name)

    async def live_model(self, model: str) -> LiveModel | None:
        """Queue ``model`` if a live worker serves it (one read, no scan); None if not, or
        if no queue can have that name."""
        try:
            keys = self.keys(model)
        except ValueError:
            return None
        client = await self.clients.for_key(keys.workers)
        return self._live(model, await client.hvals(keys.workers))

    def _live(self, name: str, beats: list[bytes | str]) -> LiveModel | None:
        live = live_times(beats, self.worker_stale_after_s, time.time())
        return LiveModel(name, len(live), int(min(live))) if live else None

    async def close(self) -> None:
        for producer in self._producers.values():
            await producer.close()
        await self.clients.aclose()
        await self.redis.aclose(close_connection_pool=True)


def _queue_of(key: bytes | str, prefix: str) -> str | None:
    text = key.decode() if isinstance(key, bytes) else key
    head, tail = f"{prefix}:{{", "}:workers"
    if not (text.startswith(head) and text.endswith(tail)):
        return None
    return text[len(head) : -len(tail)] or None

"""While its engine loads (minutes, for a large model) a worker's heartbeat says it serves
the queue, not ready yet, so producers wait for it rather than hearing there is none; a
load that fails takes the heartbeat back."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from exlq.producer.worker_watch import WorkerWatch
from exlq.protocol.keys import QueueKeys
from exlq.worker.broker import Broker
from exlq.worker.main import _heartbeats_while_loading
from exlq.worker.settings import WorkerSettings

pytestmark = pytest.mark.integration


@pytest.fixture
async def loading(
    redis_url: str, queue_name: str
) -> AsyncIterator[tuple[WorkerSettings, Broker, QueueKeys]]:
    """A worker's settings (heartbeats every 0.1 s) and broker, as serve() has them while
    its engine loads."""
    settings = WorkerSettings.load(
        engine="echo", redis_url=redis_url, queue=queue_name, heartbeat_seconds=0.1
    )
    keys = QueueKeys(queue_name)
    broker = Broker.from_url(redis_url, keys, "loader", result_ttl_s=60, dead_max_len=10)
    yield settings, broker, keys
    await broker.close()


async def test_a_loading_worker_is_seen_serving_and_not_ready(
    loading: tuple[WorkerSettings, Broker, QueueKeys], redis_client: aioredis.Redis
) -> None:
    settings, broker, keys = loading
    async with _heartbeats_while_loading(settings, broker):
        await asyncio.sleep(0.35)  # a few beats
        raw = await redis_client.hget(keys.workers, "loader")
        assert raw is not None
        assert json.loads(raw)["ready"] is False
        # A producer's check of the heartbeats counts it as a worker for the queue.
        assert await WorkerWatch(redis_client, keys).served()


async def test_a_failed_load_takes_its_heartbeat_back(
    loading: tuple[WorkerSettings, Broker, QueueKeys], redis_client: aioredis.Redis
) -> None:
    settings, broker, keys = loading
    with pytest.raises(RuntimeError, match="no model"):
        async with _heartbeats_while_loading(settings, broker):
            await asyncio.sleep(0.25)
            raise RuntimeError("no model")
    assert await redis_client.hget(keys.workers, "loader") is None

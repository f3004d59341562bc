"""Every entry whose id can be read gets an answer on that id's channel: one no parser
reads (too deep, not UTF-8), one that names two ids (both hear), one whose id has ended
(it is not run again, and hears why); and the worker goes on serving."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis

from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.worker.broker import Batch, Broker, Final

pytestmark = pytest.mark.integration


async def test_an_entry_with_several_finals_is_acked_once_by_its_last(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """Broker.commit: finals with ack=False write their job's answer and leave the entry
    pending for the one that acks it; an entry another worker owns is reported lost once."""
    keys = QueueKeys(queue_name)
    broker = Broker.from_url(redis_url, keys, "worker-a", result_ttl_s=600, dead_max_len=100)
    other = Broker.from_url(redis_url, keys, "worker-b", result_ttl_s=600, dead_max_len=100)
    try:
        await broker.ensure_group()
        await redis_client.xadd(keys.jobs, {"job": "{}"})
        await redis_client.xadd(keys.jobs, {"job": "{}"})
        [mine] = await broker.read(1, None)
        [theirs] = await other.read(1, None)
        batch = Batch()
        for entry in (mine, theirs):
            for job_id, ack in ((f"{entry.entry_id}-a", False), (f"{entry.entry_id}-b", True)):
                batch.finish(
                    Final(entry.entry_id, job_id=job_id, state="failed", result_json="{}", ack=ack)
                )
        lost = await broker.commit(batch)
    finally:
        await broker.close()
        await other.close()
    assert lost == [theirs.entry_id]
    for suffix in ("a", "b"):
        assert await redis_client.get(keys.result(f"{mine.entry_id}-{suffix}")) == b"{}"
        assert await redis_client.get(keys.result(f"{theirs.entry_id}-{suffix}")) is None
    pending = await redis_client.xpending_range(keys.jobs, CONSUMER_GROUP, "-", "+", 10)
    assert [p["message_id"].decode() for p in pending] == [theirs.entry_id]

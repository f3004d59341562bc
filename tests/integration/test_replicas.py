"""A submit that asks for replicas returns once that many hold the job (Redis WAIT), and
says so where they do not, with the job queued and safe to submit again."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer, NotReplicated
from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.echo.engine import echo_text

pytestmark = [pytest.mark.integration, pytest.mark.cluster_too]


@pytest.mark.parametrize("while_subscribed", [True, False], ids=["event-connection", "pool"])
async def test_a_submit_waits_for_the_replicas_it_asks_for(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    while_subscribed: bool,
) -> None:
    replicas = int((await redis_client.info("replication"))["connected_slaves"])
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name, replicas=1, replica_wait_ms=200) as p:
        await p._router.start()
        # A server that runs no command on a subscribed connection: the submit and its
        # WAIT go together through the pool.
        p._router.commands_while_subscribed = while_subscribed
        if replicas:  # the cluster's masters each have one
            handle = await p.submit("kept twice", id="wait-1", max_new_tokens=4)
            result = await handle.result(timeout=20)
            assert result.text == echo_text(
                GenerationRequest(prompt="kept twice", max_new_tokens=4)
            )
            return
        with pytest.raises(NotReplicated, match="0 of the 1 replicas") as raised:
            await p.submit("kept once", id="wait-1", max_new_tokens=4)
        assert raised.value.job_id == "wait-1"
        assert p._router.channel_count == 0  # its channel was let go
    # The job is queued all the same, and the same id is the same job.
    async with AsyncProducer(redis_url, queue=queue_name) as p:
        again = await p.submit("kept once", id="wait-1", max_new_tokens=4)
        assert again.duplicate
        assert (await again.result(timeout=20)).attempts == 1

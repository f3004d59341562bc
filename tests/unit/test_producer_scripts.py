"""The producer's Redis scripts, on fakeredis: dedupe, backlog cap, cancellation states."""

from __future__ import annotations

from collections.abc import AsyncIterator

import fakeredis
import pytest

from exlq.producer import AsyncProducer, QueueFull
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import DoneEvent, Timings, Usage


@pytest.fixture
async def producer() -> AsyncIterator[AsyncProducer]:
    client = fakeredis.FakeAsyncRedis()
    async with AsyncProducer(queue="unit", client=client, max_backlog=2) as made:
        yield made
    await client.aclose()


async def test_submit_records_state_and_dedupes_on_id(producer: AsyncProducer) -> None:
    keys = QueueKeys("unit")
    first = await producer.submit("hello", id="job-1")
    again = await producer.submit("different text", id="job-1")
    assert (first.duplicate, again.duplicate) == (False, True)
    status = await producer.status("job-1")
    assert status is not None and (status.state, status.attempts) == ("queued", 0)
    client = producer._redis
    assert await client.xlen(keys.jobs) == 1
    ttl = await client.ttl(keys.job("job-1"))
    assert 0 < ttl <= producer.state_ttl_s


async def test_backlog_cap_refuses_atomically(producer: AsyncProducer) -> None:
    await producer.submit("a")
    await producer.submit("b")
    with pytest.raises(QueueFull, match="holds 2 jobs, at its limit of 2"):
        await producer.submit("c", id="refused")
    assert await producer.status("refused") is None


async def test_cancel_marks_only_live_jobs(producer: AsyncProducer) -> None:
    await producer.submit("a", id="live")
    assert await producer.cancel("live") == "queued"
    assert await producer._redis.hget(QueueKeys("unit").job("live"), "cancel") == b"1"
    assert await producer.cancel("unknown") == ""
    await producer._redis.hset(QueueKeys("unit").job("live"), "state", "done")
    assert await producer.cancel("live") == "done"


async def test_a_server_without_commands_on_a_subscribed_connection_gets_two_round_trips(
    producer: AsyncProducer,
) -> None:
    # fakeredis runs only pub/sub commands on a subscribed connection: the router finds
    # that at connect, waits for the confirmation, then runs the script on the pool.
    handle = await producer.submit("hello", id="fallback")
    assert not producer._router.commands_while_subscribed
    assert producer._router.channel_count == 1
    done = DoneEvent(
        id="fallback",
        seq=0,
        finish_reason="length",
        usage=Usage(prompt_tokens=1, completion_tokens=0),
        timings=Timings(queued_s=0.0, first_token_s=None, total_s=0.0),
    )
    await producer._redis.publish(QueueKeys("unit").events("fallback"), done.model_dump_json())
    events = [event async for event in handle.stream()]
    assert events == [done]
    assert producer._router.channel_count == 0

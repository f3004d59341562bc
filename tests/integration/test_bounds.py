"""Overload, limits, deadlines, trimming and lost events: the bounds users rely on."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer, JobFailed, QueueFull, TokenEvent
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import DoneEvent, Timings, Usage

pytestmark = pytest.mark.integration


async def test_submit_fails_fast_when_the_backlog_is_full(redis_url: str, queue_name: str) -> None:
    async with AsyncProducer(redis_url, queue=queue_name, max_backlog=3) as producer:
        for i in range(3):
            await producer.submit(f"job {i}")
        with pytest.raises(QueueFull, match="at its limit of 3"):
            await producer.submit("one too many")
        # The refused job left nothing behind: no entry, no state, no subscription.
        assert producer._router.channel_count == 3


@pytest.mark.parametrize(
    ("fields", "says"),
    [
        ({"prompt": "x" * 101}, "EXLQ_MAX_PROMPT_CHARS"),
        ({"prompt": "x", "max_new_tokens": 51}, "EXLQ_MAX_NEW_TOKENS"),
        ({"messages": [{"role": "user", "content": "hi"}] * 4}, "EXLQ_MAX_MESSAGES"),
        ({"prompt": "x", "metadata": {"k": "v" * 64}}, "EXLQ_MAX_METADATA_BYTES"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
        ({"prompt": "x" * 90, "metadata": {"pad": "p" * 600}}, "EXLQ_MAX_REQUEST_BYTES"),
    ],
)
async def test_each_limit_is_refused_with_a_clear_error(
    redis_url: str, queue_name: str, start_worker: Any, fields: dict[str, Any], says: str
) -> None:
    await start_worker(
        max_prompt_chars=100,
        max_new_tokens=50,
        max_messages=3,
        max_metadata_bytes=50,
        max_request_bytes=600,
    )
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        if "stop" in fields and len(fields["stop"]) > 16:  # the contract's own bound, in the SDK
            with pytest.raises(ValueError, match="stop"):
                await producer.submit(**fields)
            return
        handle = await producer.submit(**{"max_new_tokens": 10, **fields})
        with pytest.raises(JobFailed, match=says) as caught:
            await handle.result(timeout=10)
    assert caught.value.error.code == "invalid_request"


async def test_a_job_past_its_deadline_is_not_started(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("late", max_new_tokens=5, deadline=time.time() + 0.2)
        await asyncio.sleep(0.3)
        await start_worker()
        result = await handle.result(timeout=10)
    assert result.finish_reason == "expired" and result.text == ""


async def test_a_running_job_stops_at_its_deadline(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(echo_tokens_per_second=50.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("slow", max_new_tokens=1000, deadline=time.time() + 0.5)
        result = await handle.result(timeout=10)
    assert result.finish_reason == "expired" and 0 < len(result.text.split()) < 100


async def test_the_stream_is_trimmed_only_below_what_every_group_finished(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    # A second consumer group that reads nothing: trimming must keep everything for it.
    await redis_client.xgroup_create(keys.jobs, "audit", id="0", mkstream=True)
    running = await start_worker(trim_interval_seconds=0.1)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        for i in range(10):
            await (await producer.submit(f"job {i}", max_new_tokens=1)).result(timeout=10)
    await asyncio.sleep(0.5)
    assert await redis_client.xlen(keys.jobs) == 10
    await redis_client.xgroup_destroy(keys.jobs, "audit")
    await asyncio.sleep(0.5)
    assert await redis_client.xlen(keys.jobs) == 0
    assert running.worker.ready


async def test_a_subscriber_that_missed_events_recovers_the_whole_text(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """Events 1 and 2 never arrive (a subscriber cut off by Redis, say): the handle must
    not hand out text with a hole; it finishes from the stored result."""
    keys = QueueKeys(queue_name)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("ignored", id="gappy")
        channel = keys.events("gappy")
        usage = Usage(prompt_tokens=1, completion_tokens=4)
        timings = Timings(queued_s=0.0, first_token_s=0.1, total_s=0.2)
        for seq, text in ((0, "a"), (3, "d")):
            event = TokenEvent(id="gappy", seq=seq, text=text, token_ids=[seq])
            await redis_client.publish(channel, event.model_dump_json())
        await redis_client.set(
            keys.result("gappy"),
            (
                '{"v":1,"id":"gappy","state":"done","text":"abcd","finish_reason":"length",'
                f'"usage":{usage.model_dump_json()},"timings":{timings.model_dump_json()},'
                '"attempts":1}'
            ),
        )
        done = DoneEvent(id="gappy", seq=4, finish_reason="length", usage=usage, timings=timings)
        await redis_client.publish(channel, done.model_dump_json())
        texts = [piece async for piece in handle.stream_text()]
        result = await handle.result(timeout=5)
    assert "".join(texts) == "abcd" == result.text


async def test_a_subscriber_cut_off_by_redis_recovers_the_whole_text(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    """Redis drops pub/sub clients that fall behind (client-output-buffer-limit pubsub);
    CLIENT KILL TYPE pubsub does the same on cue. The SDK reconnects, and its stream
    still yields the whole text, once."""
    await start_worker(echo_tokens_per_second=100.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("cut off", max_new_tokens=150)
        pieces: list[str] = []
        async for piece in handle.stream_text():
            pieces.append(piece)
            if len(pieces) == 20:
                assert await redis_client.client_kill_filter(_type="pubsub") >= 1
        result = await handle.result(timeout=20)
    assert "".join(pieces) == result.text == " cut off" * 75

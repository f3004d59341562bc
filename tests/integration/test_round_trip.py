"""Jobs through the SDK, a real Redis and an echo worker, async and sync."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest

from exlq.producer import AsyncProducer, DoneEvent, Producer, TokenEvent
from exlq.protocol.models import GenerationRequest, JobResult, Timings, Usage
from exlq.worker.engines.echo.engine import echo_text

pytestmark = [pytest.mark.integration, pytest.mark.cluster_too]


async def test_async_round_trip_streams_then_stores_the_same_text(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("the quick brown fox", max_new_tokens=12)
        events = [event async for event in handle.stream()]
        result = await handle.result(timeout=10)

    tokens = [e for e in events if isinstance(e, TokenEvent)]
    done = events[-1]
    assert isinstance(done, DoneEvent)
    assert [e.seq for e in events] == list(range(len(events)))
    streamed = "".join(t.text for t in tokens)
    assert (
        streamed
        == result.text
        == echo_text(GenerationRequest(prompt="the quick brown fox", max_new_tokens=12))
    )
    assert done.finish_reason == "length" == result.finish_reason
    assert done.usage.completion_tokens == 12
    assert done.timings.first_token_s is not None
    assert 0 <= done.timings.queued_s <= done.timings.first_token_s <= done.timings.total_s


async def test_stream_text_yields_only_text(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("one two", max_new_tokens=5)
        pieces = [piece async for piece in handle.stream_text()]
    assert "".join(pieces) == " one two one two one"


async def test_sync_producer_round_trip(redis_url: str, queue_name: str, start_worker: Any) -> None:
    await start_worker()

    def produce() -> tuple[list[str], str, str]:
        with Producer(redis_url, queue=queue_name) as producer:
            streamed = producer.submit("alpha beta", max_new_tokens=4)
            texts = list(streamed.stream_text())
            waited = producer.submit("gamma", max_new_tokens=3)
            result = waited.result(timeout=10)
            assert producer.status(waited.id) is not None
            return texts, result.text, producer.status(waited.id).state  # type: ignore[union-attr]

    # The blocking SDK runs on a thread while this loop serves the worker.
    texts, text, state = await asyncio.to_thread(produce)
    assert "".join(texts) == " alpha beta alpha beta"
    assert text == " gamma gamma gamma"
    assert state == "done"


async def test_same_id_twice_is_one_job(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: Any
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        first = await producer.submit("x y", max_new_tokens=3, id="order-42")
        first_result = await first.result(timeout=10)
        second = await producer.submit("something else", max_new_tokens=9, id="order-42")
        second_result = await second.result(timeout=10)
    assert not first.duplicate and second.duplicate
    assert second_result == first_result
    assert await redis_client.xlen(f"exlq:{{{queue_name}}}:jobs") == 1


async def test_stop_string_ends_the_job_without_the_stop_text(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("a b c", max_new_tokens=20, stop=["c a"])
        result = await handle.result(timeout=10)
    assert result.text == " a b "
    assert result.finish_reason == "stop"


async def test_a_burst_of_concurrent_submits_waits_for_connections(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(max_batch_size=64, echo_tokens_per_second=2000.0)
    async with AsyncProducer(redis_url, queue=queue_name, max_connections=8) as producer:
        handles = await asyncio.gather(
            *(producer.submit(f"burst {i}", max_new_tokens=2) for i in range(300))
        )
        results = await asyncio.gather(*(h.result(timeout=30) for h in handles))
    assert [r.text for r in results] == [f" burst {i}" for i in range(300)]


async def test_a_stream_whose_events_never_come_ends_from_the_stored_result(
    redis_url: str, queue_name: str, redis_client: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The worker's events were lost (say the pub/sub connection dropped unnoticed) but its
    # result was stored: after RESULT_POLL_S of quiet the handle reads the result.
    monkeypatch.setattr("exlq.producer.client.RESULT_POLL_S", 0.2)
    monkeypatch.setattr("exlq.producer.client.WORKER_CHECK_S", 0.2)
    # No worker runs here: the job must wait for one, not be cancelled for want of one.
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        handle = await producer.submit("lost events", max_new_tokens=2)
        stored = JobResult(
            id=handle.id,
            state="done",
            text="from the store",
            finish_reason="length",
            usage=Usage(prompt_tokens=2, completion_tokens=2, cached_tokens=0),
            timings=Timings(queued_s=0.0, first_token_s=0.1, total_s=0.2),
        )
        await redis_client.set(producer.keys.result(handle.id), stored.model_dump_json())
        result = await handle.result(timeout=10)
    assert result.text == "from the store"
    assert result.state == "done"


async def test_packed_ids_reach_the_engine_as_the_same_prompt(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: Any
) -> None:
    # pack_ids=True writes input_ids as input_ids_b64; the worker reads the same ids.
    await start_worker()
    ids = [5, 31_999, 70_000, 2**31 + 1]
    async with AsyncProducer(redis_url, queue=queue_name, pack_ids=True) as producer:
        packed = await (await producer.submit(input_ids=ids, max_new_tokens=6)).result(timeout=10)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        listed = await (await producer.submit(input_ids=ids, max_new_tokens=6)).result(timeout=10)
    assert packed.state == listed.state == "done"
    assert (
        packed.text == listed.text == echo_text(GenerationRequest(input_ids=ids, max_new_tokens=6))
    )
    entries = await redis_client.xrange(f"exlq:{{{queue_name}}}:jobs")
    wire = [json.loads(fields[b"job"]) for _, fields in entries]
    assert [("input_ids_b64" in job, "input_ids" in job) for job in wire] == [
        (True, False),
        (False, True),
    ]


async def _subscribers(redis_client: Any, producer: AsyncProducer, job_id: str) -> int:
    """The subscribers of the job's channel: its own (PUBSUB NUMSUB), or on a Redis
    Cluster its shard channel (PUBSUB SHARDNUMSUB, on the queue's master)."""
    version = producer._router.version
    channel = producer.keys.channel(job_id, version)
    numsub = "SHARDNUMSUB" if version == 2 else "NUMSUB"
    _, count = await redis_client.execute_command("PUBSUB", numsub, channel)
    return int(count)


async def _no_subscriber_left(redis_client: Any, producer: AsyncProducer, job_id: str) -> None:
    """The SDK sends the unsubscribe without waiting for Redis's word (nothing depends on
    it): another connection sees it gone once Redis has read it, a moment later."""
    async with asyncio.timeout(5):
        while await _subscribers(redis_client, producer, job_id):
            await asyncio.sleep(0.01)


async def test_a_stream_left_early_goes_on_in_result_and_a_detached_job_lets_its_channel_go(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: Any
) -> None:
    """A caller that stops reading a stream half-way still gets the result, and the channel
    goes with it; a job detached (its result to be read later) holds no subscription and
    still runs."""
    await start_worker(echo_tokens_per_second=50.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        left = await producer.submit("one two three four five six", max_new_tokens=8)
        async for event in left.stream():
            if isinstance(event, TokenEvent):
                break
        assert (await left.result(timeout=10)).state == "done"
        await _no_subscriber_left(redis_client, producer, left.id)
        detached = await producer.submit("a b", max_new_tokens=2)
        assert await _subscribers(redis_client, producer, detached.id) == 1
        await detached.detach()
        await _no_subscriber_left(redis_client, producer, detached.id)
        async with asyncio.timeout(10):
            while (stored := await producer.get_result(detached.id)) is None:
                await asyncio.sleep(0.02)
        assert stored.state == "done" and stored.text.split() == ["a", "b"]


async def test_a_request_of_version_2_on_a_redis_without_sharded_pubsub_is_refused(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: Any
) -> None:
    """Wire version 2 puts a job's events on its queue's shard channel (SPUBLISH); the
    bundled Redis 6.2 has none, and the refusal says so (in the stored result)."""
    info = await redis_client.info("server")
    if int(str(info["redis_version"]).split(".")[0]) >= 7:
        pytest.skip("this Redis has sharded pub/sub")
    await start_worker()
    request = {"v": 2, "id": "v2-on-6", "prompt": "x", "max_new_tokens": 2}
    await redis_client.xadd(f"exlq:{{{queue_name}}}:jobs", {"job": json.dumps(request)})
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        async with asyncio.timeout(10):
            while (stored := await producer.get_result("v2-on-6")) is None:
                await asyncio.sleep(0.02)
    assert stored.state == "failed" and stored.error is not None
    assert stored.error.code == "invalid_request" and "Redis >= 7" in stored.error.message

"""Cancelling a job mid-stream ends it with finish_reason 'cancelled' and frees its slot."""

from __future__ import annotations

from typing import Any

import pytest

from exlq.producer import AsyncProducer, DoneEvent, TokenEvent

pytestmark = [pytest.mark.integration, pytest.mark.cluster_too]


async def test_cancel_mid_stream(redis_url: str, queue_name: str, start_worker: Any) -> None:
    running = await start_worker(max_batch_size=1, echo_tokens_per_second=100.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("endless words", max_new_tokens=5_000)
        events = []
        async for event in handle.stream():
            events.append(event)
            if len(events) == 3:
                assert await handle.cancel() == "running"
        result = await handle.result(timeout=5)

        assert isinstance(events[-1], DoneEvent)
        assert events[-1].finish_reason == "cancelled" == result.finish_reason
        assert result.state == "cancelled"
        tokens = [e for e in events if isinstance(e, TokenEvent)]
        assert 3 <= len(tokens) < 100
        assert result.text == "".join(t.text for t in tokens)

        # The only slot is free again: the next job runs.
        after = await (await producer.submit("next", max_new_tokens=2)).result(timeout=5)
    assert after.text == " next next"
    assert running.worker.held == {}


async def test_cancel_before_start_never_runs(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("never", max_new_tokens=5)
        assert await handle.cancel() == "queued"
        await start_worker()
        events = [event async for event in handle.stream()]
        result = await handle.result(timeout=5)
    assert [e.type for e in events] == ["done"]
    assert result.finish_reason == "cancelled" and result.text == ""


async def test_cancel_unknown_job_says_so(redis_url: str, queue_name: str) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        assert await producer.cancel("no-such-job") == ""


async def test_a_job_running_longer_than_the_result_ttl_keeps_its_state_and_cancels(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    """The state hash of a running job outlives the result TTL (the worker's claim renewals
    refresh it): its attempt count and its cancel flag hold for the whole run."""
    await start_worker(
        max_batch_size=1, echo_tokens_per_second=10.0, result_ttl_seconds=1, claim_idle_ms=400
    )
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("long run", max_new_tokens=100)
        events = []
        async for event in handle.stream():
            events.append(event)
            if len(events) == 25:  # 2.5 s into the run, well past the TTL
                status = await producer.status(handle.id)
                assert status is not None and (status.state, status.attempts) == ("running", 1)
                assert await handle.cancel() == "running"
        result = await handle.result(timeout=5)
    assert result.finish_reason == "cancelled" and result.attempts == 1
    assert 25 <= len([e for e in events if isinstance(e, TokenEvent)]) < 100

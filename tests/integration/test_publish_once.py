"""Each event reaches subscribers once: a commit whose reply was lost is sent again without
publishing again, and a worker paused past the claim idle time publishes nothing for the
jobs another worker took over meanwhile."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from typing import Any

import pytest
from redis.exceptions import ConnectionError as RedisConnectionError

from exlq.producer import AsyncProducer
from tests.conftest import wait_until, worker_process
from tests.raw_events import raw_events

pytestmark = pytest.mark.integration


async def test_a_commit_whose_reply_was_lost_publishes_nothing_twice(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    running = await start_worker(echo_tokens_per_second=100.0)
    broker = running.worker.broker
    script = broker._commit
    lost_replies: list[int] = []

    async def reply_lost(**call: Any) -> Any:
        reply = await script(**call)  # Redis ran it...
        if len(lost_replies) < 3:  # ...and the connection dropped before its reply came
            lost_replies.append(1)
            raise RedisConnectionError("connection reset by peer")
        return reply

    broker._commit = reply_lost  # type: ignore[method-assign]
    async with raw_events(redis_url) as recorder:
        async with AsyncProducer(redis_url, queue=queue_name) as producer:
            handle = await producer.submit("once", max_new_tokens=8)
            result = await handle.result(timeout=20)
        await asyncio.sleep(0.2)
    events = recorder.of(handle.id)
    assert len(lost_replies) == 3
    assert recorder.repeats() == {}
    assert [e["seq"] for e in events] == list(range(len(events)))  # none twice, none lost
    assert events[-1]["type"] == "done"
    assert result.text == " once" * 8


async def test_a_worker_paused_past_the_claim_idle_time_publishes_nothing_stale(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    """SIGSTOP the worker's main process mid-job (its engine process runs on), let another
    worker take the job over, then SIGCONT: what the paused worker's engine made meanwhile
    must not reach the job's subscribers after the retry began."""
    paused = worker_process(
        redis_url,
        queue_name,
        "--engine",
        "echo",
        "-o",
        "tokens_per_second=40",
        EXLQ_CLAIM_IDLE_MS="1000",
        EXLQ_HEARTBEAT_SECONDS="0.2",
    )
    try:
        async with raw_events(redis_url) as recorder:
            async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as p:
                handle = await p.submit("stale", max_new_tokens=200)
                await wait_until(lambda: len(recorder.of(handle.id)) >= 5, 30)
                paused.send_signal(signal.SIGSTOP)
                await start_worker(echo_tokens_per_second=100.0, claim_idle_ms=1000)
                await wait_until(lambda: any(e["attempt"] == 2 for e in recorder.of(handle.id)))
                await asyncio.sleep(1.0)  # the paused worker's engine makes more meanwhile
                paused.send_signal(signal.SIGCONT)
                result = await handle.result(timeout=30)
            await asyncio.sleep(0.5)
        stale = recorder.stale(handle.id)
        print(f"\npaused worker: {len(stale)} stale events after the retry began")
        assert stale == []
        assert recorder.repeats() == {}
        assert result.attempts == 2 and result.text == " stale" * 200
        done = [e for e in recorder.of(handle.id) if e["type"] == "done"]
        assert len(done) == 1
    finally:
        paused.send_signal(signal.SIGCONT)
        _stop(paused)


def _stop(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.terminate()
    try:
        process.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()


async def test_a_batch_over_one_calls_size_goes_as_several_calls_in_order(
    redis_url: str, queue_name: str, redis_client: Any
) -> None:
    """A batch larger than MAX_CALL_BYTES is written as several script calls, in order. The
    reply to one of them lost, the batch is sent again: the calls answered before are not
    sent, the one Redis ran is answered from the marker, and every event arrives once."""
    from exlq.protocol.keys import QueueKeys
    from exlq.worker.broker import Broker
    from exlq.worker.commit_batch import MAX_CALL_BYTES, Batch
    from exlq.worker.lanes import TakePlan

    keys = QueueKeys(queue_name)
    broker = Broker.from_url(redis_url, keys, "big-writer", result_ttl_s=60, dead_max_len=10)
    await broker.ensure_group()
    await redis_client.xadd(keys.jobs, {"job": "{}"})
    [entry] = (
        await broker.read(TakePlan.any_lane(1), None)
    ).entries  # its events are this worker's to publish
    script = broker._commit
    calls: list[int] = []

    async def second_reply_lost(**call: Any) -> Any:
        calls.append(len(call["args"][5]))
        reply = await script(**call)
        if len(calls) == 2:
            raise RedisConnectionError("connection reset by peer")
        return reply

    broker._commit = second_reply_lost  # type: ignore[method-assign]
    chunk = "x" * (MAX_CALL_BYTES // 3)
    batch = Batch()
    for seq in range(7):
        batch.publish(keys.events("big"), f'{{"seq": {seq}, "text": "{chunk}"}}', entry.entry_id)
    try:
        async with raw_events(redis_url, keys.events("big")) as recorder:
            with pytest.raises(RedisConnectionError):
                await broker.commit(batch)
            await broker.commit(batch)  # as the worker's retry does
            await wait_until(lambda: len(recorder.events) >= 7, 10)
            await asyncio.sleep(0.2)
    finally:
        await broker.close()
    assert [e["seq"] for e in recorder.events] == list(range(7))
    assert max(calls) <= MAX_CALL_BYTES
    parts = len(calls) - 1  # the call whose reply was lost went twice
    assert len(batch.answered) == parts >= 3

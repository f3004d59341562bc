"""Submits made at once go to Redis together, and each caller still gets its own outcome."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from exlq.producer import AsyncProducer, JobHandle, QueueFull
from exlq.producer.submit_batch import EAGER_SEND, FIRST_PIECE_JOBS, PIECE_JOBS, SubmitBatcher
from exlq.producer.subscriber import EventRouter
from exlq.protocol.keys import QueueKeys

pytestmark = pytest.mark.integration


async def _calls(client: aioredis.Redis, command: str) -> int:
    stats = await client.info("commandstats")
    return int(stats.get(f"cmdstat_{command}", {}).get("calls", 0))


async def test_a_burst_of_submits_is_one_subscribe_and_one_script_and_every_job_runs(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        await producer.submit("warm up", max_new_tokens=1)  # the script is loaded
        await redis_client.config_resetstat()
        count = FIRST_PIECE_JOBS  # a burst that fits the first piece
        prompts = [f"job {i} of the burst" for i in range(count)]
        handles = await asyncio.gather(
            *(producer.submit(p, max_new_tokens=4, id=f"burst-{i}") for i, p in enumerate(prompts))
        )
        assert await _calls(redis_client, "subscribe") == 1
        assert await _calls(redis_client, "evalsha") == 1
        assert [h.id for h in handles] == [f"burst-{i}" for i in range(count)]
        # One script enqueued them: the stream holds them in submit order, together, and
        # none says more follows.
        entries = await redis_client.xrange(QueueKeys(queue_name).jobs)
        ids = [json.loads(fields[b"job"])["id"] for _, fields in entries]
        assert ids[-count:] == [f"burst-{i}" for i in range(count)]
        assert not any(b"more" in fields for _, fields in entries)
        await start_worker(max_batch_size=64)  # only now: its own scripts are EVALSHA too
        results = await asyncio.gather(*(h.result(timeout=30) for h in handles))
    for prompt, result in zip(prompts, results, strict=True):
        # The echo engine repeats the prompt's words: each handle got its own job's events.
        assert result.state == "done"
        assert result.text.split() == prompt.split()[:4]


async def test_a_full_queue_refuses_only_the_submits_past_its_limit(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name, max_backlog=3) as producer:
        outcomes = await asyncio.gather(
            *(producer.submit(f"job {i}", max_new_tokens=2) for i in range(5)),
            return_exceptions=True,
        )
        refused = [o for o in outcomes if isinstance(o, QueueFull)]
        assert len(refused) == 2
        assert "at its limit of 3" in str(refused[0])
        # Only the three queued jobs keep a subscription.
        assert producer._router.channel_count == 3
    assert await redis_client.xlen(QueueKeys(queue_name).jobs) == 3


async def test_a_job_that_fails_in_the_script_fails_alone(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.set(keys.job("squatted"), "not a job hash")  # HGET on it: WRONGTYPE
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        before, bad, after = await asyncio.gather(
            producer.submit("before it", max_new_tokens=2, id="before"),
            producer.submit("the bad one", max_new_tokens=2, id="squatted"),
            producer.submit("after it", max_new_tokens=2, id="after"),
            return_exceptions=True,
        )
        assert isinstance(bad, ResponseError)
        assert "WRONGTYPE" in str(bad)
        assert isinstance(before, JobHandle) and isinstance(after, JobHandle)
        done = await asyncio.wait_for(asyncio.gather(before.result(), after.result()), 10)
        assert [r.text.split() for r in done] == [["before", "it"], ["after", "it"]]
        assert producer._router.channel_count == 0  # the bad job's channel was left too
    assert await redis_client.get(keys.job("squatted")) == b"not a job hash"


async def test_the_same_id_twice_in_one_burst_is_one_job_with_two_live_handles(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        first, second = await asyncio.gather(
            producer.submit("same job twice", max_new_tokens=3, id="twin"),
            producer.submit("same job twice", max_new_tokens=3, id="twin"),
        )
        assert sorted([first.duplicate, second.duplicate]) == [False, True]
        one, two = await asyncio.wait_for(
            asyncio.gather(first.result(), second.result()), timeout=10
        )
        assert one.text == two.text
        assert one.text.split() == ["same", "job", "twice"]
        assert producer._router.channel_count == 0


async def test_a_submit_cancelled_while_its_batch_is_out_leaves_no_subscription(
    redis_url: str, queue_name: str
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        kept = asyncio.create_task(producer.submit("kept", max_new_tokens=2))
        dropped = asyncio.create_task(producer.submit("dropped", max_new_tokens=2))
        await asyncio.sleep(0)  # both are in the batch now
        dropped.cancel()
        handle = await kept
        with pytest.raises(asyncio.CancelledError):
            await dropped
        await producer._submits["interactive"].close()
        assert producer._router.channel_count == 1
        await handle.detach()
        assert producer._router.channel_count == 0


async def test_a_burst_larger_than_a_piece_goes_out_in_pieces_in_order(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    log: list[tuple[str, int]] = []
    real_submit, real_subscribe_then = SubmitBatcher.submit, EventRouter.subscribe_then

    async def submit(self: SubmitBatcher, job_id: str, request_json: str) -> Any:
        log.append(("submit", 1))
        return await real_submit(self, job_id, request_json)

    async def subscribe_then(
        self: EventRouter, channels: list[str], command: Any, then: Any = None
    ) -> Any:
        log.append(("send", len(channels)))
        return await real_subscribe_then(self, channels, command, then)

    count = 2 * PIECE_JOBS + 44
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        await producer.submit("warm up", max_new_tokens=1)
        await redis_client.config_resetstat()
        monkeypatch.setattr(SubmitBatcher, "submit", submit)
        monkeypatch.setattr(EventRouter, "subscribe_then", subscribe_then)
        handles = await asyncio.gather(
            *(producer.submit(f"job {i}", max_new_tokens=1, id=f"p-{i}") for i in range(count))
        )
        if EAGER_SEND:
            # Python >= 3.12: a piece is written once it is full and a submit waits behind
            # it, while the rest of the burst is submitted; the pass's first PIECE_JOBS go
            # in pieces of FIRST_PIECE_JOBS.
            pieces = [FIRST_PIECE_JOBS] * (PIECE_JOBS // FIRST_PIECE_JOBS)
            pieces += [PIECE_JOBS, PIECE_JOBS]
            pieces.append(count - sum(pieces))
        else:
            pieces = [PIECE_JOBS, PIECE_JOBS, PIECE_JOBS, count - 3 * PIECE_JOBS]
        assert await _calls(redis_client, "subscribe") == len(pieces)
        assert await _calls(redis_client, "evalsha") == len(pieces)
        assert producer._router.channel_count == count + 1
    entries = await redis_client.xrange(QueueKeys(queue_name).jobs)
    assert (
        [json.loads(fields[b"job"])["id"] for _, fields in entries[1:]]
        == [h.id for h in handles]
        == [f"p-{i}" for i in range(count)]
    )
    sends = [n for kind, n in log if kind == "send"]
    assert sends == pieces
    first_send = log.index(("send", pieces[0]))
    assert first_send == (FIRST_PIECE_JOBS + 1 if EAGER_SEND else count)
    # Every entry but those of the last piece says more of its burst follows; the lone
    # submit before the burst does not.
    marks = [fields.get(b"more") for _, fields in entries]
    last = pieces[-1]
    assert marks == [None] + [b"1"] * (count - last) + [None] * last

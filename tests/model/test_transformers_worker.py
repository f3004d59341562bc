"""The transformers engine behind a real worker: jobs through the SDK, a real Redis and
SmolLM2-135M-Instruct, several at once."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exlq.producer import AsyncProducer, DoneEvent, TokenEvent
from exlq.protocol.models import JobResult
from exlq.worker.engines.base import Engine
from tests.model.jobs import CAPITAL

pytestmark = [pytest.mark.model, pytest.mark.integration]

GREEDY = {"temperature": 0.0}


def asked(**fields: Any) -> dict[str, Any]:
    """The capital-of-France question as submit()'s fields, greedy unless told otherwise."""
    return {"messages": CAPITAL, "sampling": GREEDY, "max_new_tokens": 16, **fields}


async def test_a_greedy_chat_answers_paris_and_streams_what_it_stores(
    engine: Engine, redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit(**asked())
        events = [event async for event in handle.stream()]
        result = await handle.result(timeout=60)
    done = events[-1]
    assert isinstance(done, DoneEvent)
    streamed = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert "Paris" in result.text
    assert streamed == result.text
    assert done.finish_reason == result.finish_reason == "stop"
    assert done.usage.prompt_tokens > 20 and 0 < done.usage.completion_tokens < 16


async def test_jobs_at_once_each_end_as_they_asked(
    engine: Engine, redis_url: str, queue_name: str, start_worker: Any
) -> None:
    """Five jobs in one batch: a stop string, a length limit, a plain greedy answer and a
    seeded sampled job twice (its own random generator: the same text both times)."""
    await start_worker(engine=engine)
    seeded = asked(sampling={"temperature": 1.0, "top_p": 0.95, "seed": 7}, max_new_tokens=24)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = await asyncio.gather(
            producer.submit(**asked(stop=["Paris"])),
            producer.submit(**asked(max_new_tokens=3)),
            producer.submit(**asked()),
            producer.submit(**seeded),
            producer.submit(**seeded),
        )
        results: list[JobResult] = await asyncio.gather(*(h.result(timeout=60) for h in handles))
    stop, length, greedy, sampled, sampled_again = results
    assert (stop.text, stop.finish_reason) == ("The capital of France is ", "stop")
    assert (length.text, length.finish_reason) == ("The capital of", "length")
    assert length.usage is not None and length.usage.completion_tokens == 3
    assert "Paris" in greedy.text and greedy.finish_reason == "stop"
    assert sampled.state == sampled_again.state == "done"
    assert sampled.text == sampled_again.text != ""


async def test_cancel_ends_a_running_job(
    engine: Engine, redis_url: str, queue_name: str, start_worker: Any
) -> None:
    running = await start_worker(engine=engine)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit(**asked(ignore_eos=True, max_new_tokens=400))
        tokens = 0
        async for event in handle.stream():
            if isinstance(event, TokenEvent):
                tokens += 1
                if tokens == 3:
                    assert await handle.cancel() == "running"
        result = await handle.result(timeout=30)
    assert result.state == "cancelled" and result.finish_reason == "cancelled"
    assert result.usage is not None and 3 <= result.usage.completion_tokens < 100
    assert running.worker.held == {}
    assert engine.active_jobs == 0

"""A job's metrics at its end, through a real Redis and worker: the per-request token
histograms observe each job the engine ran once, and only those; the prefix cache counters
count the prompts an engine looked up in its cache, and what it found."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from exlq.producer import AsyncProducer, TokenEvent
from exlq.worker.engines.base import EngineOutput, JobEnded
from exlq.worker.engines.echo.engine import EchoEngine

pytestmark = pytest.mark.integration


class _HalfCachedEcho(EchoEngine):
    """An engine with a prefix cache that finds half of every prompt there."""

    def step(self) -> list[EngineOutput]:
        return [
            msgspec.structs.replace(out, cached_tokens=out.prompt_tokens // 2)
            if isinstance(out, JobEnded)
            else out
            for out in super().step()
        ]


async def test_each_job_the_engine_ran_is_observed_once_in_the_token_histograms(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        deadline = time.time() + 0.2
        late = await producer.submit("never runs at all", max_new_tokens=5, deadline=deadline)
        await asyncio.sleep(deadline - time.time() + 0.05)  # past its deadline: never started
        running = await start_worker()
        short = await producer.submit("a b c", max_new_tokens=4)
        long = await producer.submit(" ".join(f"w{i}" for i in range(12)), max_new_tokens=25)
        results = [await h.result(timeout=10) for h in (late, short, long)]
    assert [r.finish_reason for r in results] == ["expired", "length", "length"]
    value = running.metrics.registry.get_sample_value
    q = {"queue": queue_name}

    def bucket(name: str, le: str) -> float | None:
        return value(f"exlq_request_{name}_tokens_bucket", {**q, "le": le})

    assert value("exlq_request_prompt_tokens_count", q) == 2  # not the expired job
    assert value("exlq_request_prompt_tokens_sum", q) == 15
    assert [bucket("prompt", le) for le in ("2.0", "5.0", "10.0", "20.0")] == [0, 1, 1, 2]
    assert value("exlq_request_generation_tokens_sum", q) == 29
    assert [bucket("generation", le) for le in ("2.0", "5.0", "20.0", "50.0")] == [0, 1, 1, 2]
    assert value("exlq_prompt_tokens_total", q) == 15
    # The echo engine has no prefix cache: no lookups, so no hit ratio to read.
    assert value("exlq_prefix_cache_queries_total", q) == 0
    assert value("exlq_prefix_cache_hits_total", q) == 0
    completed = {"queue": queue_name, "lane": "interactive"}
    for reason, jobs in (("expired", 1), ("length", 2), ("stop", 0), ("cancelled", 0)):
        labels = {**completed, "finish_reason": reason}
        assert value("exlq_jobs_completed_total", labels) == jobs, reason


async def test_prefix_cache_counters_count_the_prompts_an_engine_looked_up(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    running = await start_worker(engine=_HalfCachedEcho(capacity=4, tokens_per_second=200.0))
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        cached = await producer.submit(" ".join(f"w{i}" for i in range(10)), max_new_tokens=3)
        endless = await producer.submit("one two three four five six", max_new_tokens=5_000)
        async for event in endless.stream():
            if isinstance(event, TokenEvent):
                break
        await endless.cancel()  # ends in the engine's cancel(): no lookup reported
        results = [await h.result(timeout=10) for h in (cached, endless)]
    assert [r.finish_reason for r in results] == ["length", "cancelled"]
    assert [r.usage.cached_tokens for r in results if r.usage] == [5, 0]
    value = running.metrics.registry.get_sample_value
    q = {"queue": queue_name}
    assert value("exlq_prompt_tokens_total", q) == 16
    assert value("exlq_prefix_cache_queries_total", q) == 10
    assert value("exlq_prefix_cache_hits_total", q) == 5
    assert value("exlq_request_prompt_tokens_count", q) == 2

"""Workers that die lose no job; live workers keep their long jobs; Redis restarts lose none."""

from __future__ import annotations

import asyncio
import signal
import subprocess
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer, DoneEvent, RequeuedEvent, TokenEvent
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.worker.embedded_redis import RedisServer
from tests.conftest import worker_process

pytestmark = pytest.mark.integration

FAST_RECLAIM = {"EXLQ_CLAIM_IDLE_MS": "1000", "EXLQ_HEARTBEAT_SECONDS": "0.5"}


def _kill(process: subprocess.Popen[str]) -> None:
    if process.poll() is None:
        process.kill()
    process.communicate(timeout=30)


@pytest.mark.cluster_too
async def test_kill_9_mid_stream_the_job_completes_on_another_worker(
    redis_url: str, queue_name: str
) -> None:
    doomed = worker_process(
        redis_url, queue_name, "--engine", "echo", "-o", "tokens_per_second=20", **FAST_RECLAIM
    )
    survivor: subprocess.Popen[str] | None = None
    try:
        # The worker process may still be starting when the job has waited 3 s.
        async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
            handle = await producer.submit("one two three", max_new_tokens=40)
            events: list[Any] = []
            stream = handle.stream()
            while len(events) < 5:
                events.append(await asyncio.wait_for(anext(stream), 30))
            doomed.send_signal(signal.SIGKILL)
            survivor = worker_process(
                redis_url,
                queue_name,
                "--engine",
                "echo",
                "-o",
                "tokens_per_second=200",
                **FAST_RECLAIM,
            )
            async with asyncio.timeout(60):
                events += [event async for event in stream]
            result = await handle.result(timeout=10)
    finally:
        _kill(doomed)
        if survivor is not None:
            _kill(survivor)

    kinds = [e.type for e in events]
    assert "requeued" in kinds, kinds
    restart = kinds.index("requeued")
    requeued = events[restart]
    assert isinstance(requeued, RequeuedEvent) and requeued.attempt == 2
    after = events[restart + 1 :]
    text = "".join(e.text for e in after if isinstance(e, TokenEvent))
    assert text == result.text == " one two three" * 13 + " one"
    assert isinstance(events[-1], DoneEvent) and events[-1].finish_reason == "length"
    assert result.attempts == 2


@pytest.mark.cluster_too
async def test_a_job_longer_than_the_claim_idle_time_is_not_rerun(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    # Claims idle after 0.5 s, but the job runs for about 3 s on a live worker.
    first = await start_worker(claim_idle_ms=500, echo_tokens_per_second=20.0)
    second = await start_worker(claim_idle_ms=500, echo_tokens_per_second=20.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("long job", max_new_tokens=60)
        events = [e async for e in handle.stream()]
        result = await handle.result(timeout=10)
    assert not any(e.type == "requeued" for e in events)
    assert result.attempts == 1
    served = [
        w.metrics.registry.get_sample_value(
            "exlq_jobs_received_total", {"queue": queue_name, "lane": "interactive"}
        )
        for w in (first, second)
    ]
    assert sorted(served) == [0.0, 1.0]


async def test_redis_restart_with_aof_loses_no_job(tmp_path: Path, start_worker: Any) -> None:
    server = RedisServer(data_dir=tmp_path / "redis")
    server.start()
    queue = "restart"
    try:
        await start_worker(
            redis_url=server.url,
            queue=queue,
            echo_tokens_per_second=50.0,
            max_batch_size=8,
            claim_idle_ms=2000,
        )
        async with AsyncProducer(server.url, queue=queue) as producer:
            handles = [await producer.submit(f"job {i}", max_new_tokens=40) for i in range(20)]
            await asyncio.sleep(0.5)  # some run, some wait in the stream
            server.stop()  # SIGTERM: Redis writes its AOF and exits
            await asyncio.sleep(1.0)
            server.start()
            results = await asyncio.gather(*(h.result(timeout=90) for h in handles))
        assert {r.state for r in results} <= {"done", "expired"}
        assert all(r.text == f" job {i}" * 20 for i, r in enumerate(results))
        client = aioredis.Redis.from_url(server.url)
        keys = QueueKeys(queue)
        assert (await client.xpending(keys.jobs, CONSUMER_GROUP))["pending"] == 0
        assert await client.xlen(keys.dead) == 0
        await client.aclose()
    finally:
        server.stop()

"""Soak: 5,000 jobs through 3 workers while a chaos loop kills and restarts them."""

from __future__ import annotations

import asyncio
import json
import os
import random
import subprocess
from collections import Counter
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer import AsyncProducer
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from tests.conftest import worker_process

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOBS = int(os.environ.get("EXLQ_SOAK_JOBS", "5000"))
WORKERS = 3
TTL_S = 5
CHAOS = {
    "EXLQ_CLAIM_IDLE_MS": "1000",
    "EXLQ_ENGINE_RUNNER": "thread",  # one process a worker: the soak kills and starts many
    "EXLQ_HEARTBEAT_SECONDS": "0.5",
    "EXLQ_RESULT_TTL_SECONDS": str(TTL_S),
    "EXLQ_TRIM_INTERVAL_SECONDS": "0.5",
}


def start(redis_url: str, queue: str) -> subprocess.Popen[str]:
    return worker_process(
        redis_url,
        queue,
        "--engine",
        "echo",
        "-o",
        "tokens_per_second=100",
        "--max-batch-size",
        "8",
        "--log-level",
        "WARNING",
        **CHAOS,
    )


async def count_done_events(
    client: aioredis.Redis,
    done: Counter[str],
    seen: dict[str, list[str]],
    ready: asyncio.Event,
) -> None:
    """Count each job's done events; keep every event's (type, attempt, seq) in ``seen``,
    to show what a job that never ended was sent."""
    pubsub = client.pubsub()
    await pubsub.psubscribe("exlq:out:*")
    ready.set()
    try:
        async for message in pubsub.listen():
            if message["type"] == "pmessage":
                event = json.loads(message["data"])
                seen.setdefault(event["id"], []).append(
                    f"{event['type']}@{event['attempt']}.{event['seq']}"
                )
                if event["type"] == "done":
                    done[event["id"]] += 1
    finally:
        await pubsub.aclose()


async def chaos(
    workers: list[subprocess.Popen[str]],
    redis_url: str,
    queue: str,
    stop: asyncio.Event,
    counts: Counter[str],
) -> None:
    rng = random.Random(7)
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        victim = rng.randrange(len(workers))
        workers[victim].kill()
        await asyncio.to_thread(workers[victim].communicate)
        counts["kills"] += 1
        workers[victim] = start(redis_url, queue)
        counts["restarts"] += 1


async def used_memory(client: aioredis.Redis) -> int:
    return int((await client.info("memory"))["used_memory"])


async def test_soak_every_job_exactly_one_result_and_memory_returns(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    listener = aioredis.Redis.from_url(redis_url)
    done_events: Counter[str] = Counter()
    seen: dict[str, list[str]] = {}
    listening = asyncio.Event()
    counter = asyncio.create_task(count_done_events(listener, done_events, seen, listening))
    await listening.wait()
    start_memory = await used_memory(redis_client)
    peak_memory = start_memory
    workers = [start(redis_url, queue_name) for _ in range(WORKERS)]
    counts: Counter[str] = Counter()
    stop_chaos = asyncio.Event()
    try:
        # Worker processes start, die and start again: jobs wait for them.
        async with AsyncProducer(
            redis_url, queue=queue_name, state_ttl_s=120, wait_for_worker=True
        ) as producer:
            chaos_task = asyncio.create_task(
                chaos(workers, redis_url, queue_name, stop_chaos, counts)
            )
            handles = [
                await producer.submit(f"soak {i}", max_new_tokens=3, id=f"soak-{i}")
                for i in range(JOBS)
            ]

            async def finish(handle: Any) -> Any:
                try:
                    return await handle.result(timeout=240)
                except TimeoutError:
                    return None  # reported below, with the events its job was sent

            pending = [asyncio.create_task(finish(h)) for h in handles]
            while not all(task.done() for task in pending):
                peak_memory = max(peak_memory, await used_memory(redis_client))
                await asyncio.sleep(0.2)
            stop_chaos.set()
            await chaos_task
            results = [task.result() for task in pending]
            hung = [h.id for h, r in zip(handles, results, strict=True) if r is None]
            assert not hung, f"{len(hung)} handles never ended: " + "; ".join(
                f"{job_id}: {' '.join(seen.get(job_id, []))}" for job_id in hung[:5]
            )
        await asyncio.sleep(0.5)  # the last done events reach the listener
        lost = sum(1 for r in results if r.state != "done")
        rerun = sum(1 for r in results if r.attempts > 1)
        wrong = [r.id for i, r in enumerate(results) if r.text != f" soak {i} soak"]
        duplicated = sum(1 for h in handles if done_events[h.id] > 1)
        missing = sum(1 for h in handles if done_events[h.id] == 0)
        # After the TTLs, with the workers still trimming: back near the start.
        await asyncio.sleep(TTL_S + 1)
        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline:
            if await redis_client.xlen(keys.jobs) == 0 and await redis_client.dbsize() <= 4:
                break
            await asyncio.sleep(0.5)
        pending_left = (await redis_client.xpending(keys.jobs, CONSUMER_GROUP))["pending"]
        final_memory = await used_memory(redis_client)
        keys_left = await redis_client.dbsize()
    finally:
        stop_chaos.set()
        for process in workers:
            process.terminate()
        for process in workers:
            await asyncio.to_thread(process.communicate)
        counter.cancel()
        await asyncio.gather(counter, return_exceptions=True)  # its finally closes the pubsub
        await listener.aclose()
    print(
        f"\nsoak: jobs={JOBS} kills={counts['kills']} restarts={counts['restarts']} "
        f"rerun={rerun} lost={lost} duplicated={duplicated} peak_redis_memory={peak_memory} "
        f"final_redis_memory={final_memory} start_redis_memory={start_memory}"
    )
    assert counts["kills"] >= 3
    assert rerun > 0  # the kills hit running jobs, which other workers finished
    assert lost == 0 and not wrong and duplicated == 0 and missing == 0
    assert pending_left == 0
    assert await redis_client.xlen(keys.jobs) == 0
    # The jobs stream, the workers hash, the dead stream, the commit markers.
    assert keys_left <= 4, keys_left
    assert final_memory < start_memory + 2_000_000

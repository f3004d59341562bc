"""Soak: 5,000 jobs through 3 workers while a chaos loop kills and restarts them, one
worker is paused past the claim idle time, and Redis restarts without persistence; then
1,000 more. Redis loses what it held at the restart; exlq loses nothing, runs nothing
twice, and publishes nothing stale."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import subprocess
from collections import Counter
from dataclasses import dataclass
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError

from exlq.producer import AsyncProducer, JobFailed, JobLost
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.worker.embedded_redis import RedisServer
from tests.conftest import worker_process
from tests.raw_events import raw_events

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

JOBS = int(os.environ.get("EXLQ_SOAK_JOBS", "5000"))
WORKERS = 3
TTL_S = 5
CLAIM_IDLE_S = 1.0
CHAOS = {
    "EXLQ_CLAIM_IDLE_MS": str(int(CLAIM_IDLE_S * 1000)),
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


@dataclass
class Chaos:
    """What the chaos did, and when the Redis restart came."""

    kills: int = 0
    restarts: int = 0
    pauses: int = 0
    redis_restarts: int = 0
    paused: int | None = None  # the index of the worker stopped now
    # Jobs of the first wave not ended when Redis restarted: the most Redis can lose.
    outstanding_at_restart: int = 0


async def kill_and_restart(
    workers: list[subprocess.Popen[str]], url: str, queue: str, stop: asyncio.Event, chaos: Chaos
) -> None:
    rng = random.Random(7)
    while not stop.is_set():
        await asyncio.sleep(rng.uniform(0.5, 1.5))
        victim = rng.randrange(len(workers))
        if victim == chaos.paused:
            continue
        workers[victim].kill()
        await asyncio.to_thread(workers[victim].communicate)
        chaos.kills += 1
        workers[victim] = start(url, queue)
        chaos.restarts += 1


async def pause_one(workers: list[subprocess.Popen[str]], chaos: Chaos) -> None:
    """SIGSTOP a worker past the claim idle time, then let it go on: others rerun its jobs
    meanwhile, and it must publish nothing for them."""
    chaos.paused = 0
    workers[0].send_signal(signal.SIGSTOP)
    chaos.pauses += 1
    await asyncio.sleep(2.5 * CLAIM_IDLE_S)
    workers[0].send_signal(signal.SIGCONT)
    chaos.paused = None


async def finish(handle: Any) -> str:
    """How the job ended for its producer: done, lost by Redis, or (never) otherwise."""
    try:
        result = await handle.result(timeout=240)
    except JobLost:
        return "lost by redis"
    except JobFailed as exc:
        return "lost by redis" if exc.error.code == "lost" else f"failed: {exc.error.code}"
    except TimeoutError:
        return "hung"
    return "done" if result.text == f" {handle.id} {handle.id}" else f"wrong text {result.text!r}"


async def used_memory(client: aioredis.Redis) -> int:
    try:
        return int((await client.info("memory"))["used_memory"])
    except RedisConnectionError:  # Redis is restarting
        return 0


async def test_soak_every_job_ends_once_and_only_redis_loses_jobs() -> None:
    server = RedisServer()  # its own, without persistence: the soak restarts it
    server.start()
    url, queue = server.url, "soak"
    keys = QueueKeys(queue)
    client = aioredis.Redis.from_url(url)
    chaos = Chaos()
    workers = [start(url, queue) for _ in range(WORKERS)]
    stop_chaos = asyncio.Event()
    try:
        async with raw_events(url) as recorder:
            start_memory = peak_memory = await used_memory(client)
            # Worker processes start, die and start again: jobs wait for them.
            async with AsyncProducer(
                url, queue=queue, state_ttl_s=120, wait_for_worker=True
            ) as producer:
                killer = asyncio.create_task(
                    kill_and_restart(workers, url, queue, stop_chaos, chaos)
                )
                first = [
                    await producer.submit(f"soak-{i}", id=f"soak-{i}", max_new_tokens=2)
                    for i in range(JOBS)
                ]
                first_ends = [asyncio.create_task(finish(h)) for h in first]
                while sum(t.done() for t in first_ends) < JOBS // 10:
                    await asyncio.sleep(0.05)
                await pause_one(workers, chaos)
                while sum(t.done() for t in first_ends) < JOBS // 2:
                    peak_memory = max(peak_memory, await used_memory(client))
                    await asyncio.sleep(0.05)
                chaos.outstanding_at_restart = sum(not t.done() for t in first_ends)
                server.stop()  # no AOF, no RDB: it comes back empty
                await asyncio.sleep(0.5)
                server.start()
                chaos.redis_restarts += 1
                second = [
                    await producer.submit(f"after-{i}", id=f"after-{i}", max_new_tokens=2)
                    for i in range(JOBS // 5)
                ]
                second_ends = [asyncio.create_task(finish(h)) for h in second]
                ends = first_ends + second_ends
                while not all(t.done() for t in ends):
                    peak_memory = max(peak_memory, await used_memory(client))
                    await asyncio.sleep(0.2)
                stop_chaos.set()
                await killer
            await asyncio.sleep(0.5)  # the last events reach the listener
        first_outcomes = Counter(t.result() for t in first_ends)
        second_outcomes = Counter(t.result() for t in second_ends)
        handles = first + second
        done_heard = Counter(e["id"] for e in recorder.events if e["type"] == "done")
        duplicated = sum(1 for h in handles if done_heard[h.id] > 1)
        stale = sum(len(recorder.stale(h.id)) for h in handles)
        rerun = len({e["id"] for e in recorder.events if e["attempt"] > 1})
        lost_by_redis = first_outcomes["lost by redis"]
        lost_by_exlq = len(handles) - first_outcomes["done"] - second_outcomes["done"]
        lost_by_exlq -= lost_by_redis
        # After the TTLs, with the workers still trimming: back near the start.
        await asyncio.sleep(TTL_S + 1)
        deadline = asyncio.get_running_loop().time() + 30
        while asyncio.get_running_loop().time() < deadline:
            if await client.xlen(keys.jobs) == 0 and await client.dbsize() <= 4:
                break
            await asyncio.sleep(0.5)
        pending_left = (await client.xpending(keys.jobs, CONSUMER_GROUP))["pending"]
        final_memory = await used_memory(client)
        keys_left = await client.dbsize()
    finally:
        stop_chaos.set()
        for process in workers:
            process.send_signal(signal.SIGCONT)
            process.terminate()
        for process in workers:
            await asyncio.to_thread(process.communicate)
        await client.aclose()
        server.stop()
    print(
        f"\nsoak: jobs={len(handles)} kills={chaos.kills} restarts={chaos.restarts} "
        f"pauses={chaos.pauses} redis_restarts={chaos.redis_restarts} rerun={rerun} "
        f"outstanding_at_redis_restart={chaos.outstanding_at_restart} "
        f"lost_by_redis={lost_by_redis} lost_by_exlq={lost_by_exlq} duplicated={duplicated} "
        f"stale_events={stale} peak_redis_memory={peak_memory} "
        f"final_redis_memory={final_memory} start_redis_memory={start_memory}"
    )
    problems = {k: n for k, n in (first_outcomes + second_outcomes).items() if k != "done"}
    problems.pop("lost by redis", None)
    assert not problems, problems
    assert second_outcomes["done"] == len(second)  # all submitted after the restart
    assert lost_by_exlq == 0 and duplicated == 0 and stale == 0
    assert lost_by_redis <= chaos.outstanding_at_restart
    assert chaos.kills >= 3 and chaos.pauses == 1 and chaos.redis_restarts == 1
    assert rerun > 0  # the kills and the pause hit running jobs, which other workers finished
    assert pending_left == 0
    assert keys_left <= 4, keys_left  # jobs stream, workers hash, dead stream, commit markers
    assert final_memory < start_memory + 2_000_000

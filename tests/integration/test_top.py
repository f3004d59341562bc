"""`exlq top --once` against a real Redis: one frame, without ANSI codes in a pipe, shows a
queue's backlog, the live worker that holds a job and the tokens it makes per second (from
its heartbeats), and a dead letter's error."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner

from exlq.cli import app
from exlq.ops.queue_stats import QueueReader
from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys

pytestmark = pytest.mark.integration


@pytest.mark.cluster_too
async def test_top_once_shows_backlog_worker_and_dead_letter(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await start_worker(max_batch_size=1, echo_tokens_per_second=50.0, heartbeat_seconds=0.5)
    await redis_client.xadd(keys.jobs, {"job": "{not json"})  # a dead letter, at once
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [await producer.submit(f"job {i}", max_new_tokens=500) for i in range(5)]
        reader = QueueReader(redis_client, "exlq")
        async with asyncio.timeout(10):
            while True:
                stats = await reader.read(queue_name)
                rate = stats.tokens_per_s
                if stats.pending == 1 and stats.dead_letters == 1 and rate:  # a job's 2nd beat
                    break
                await asyncio.sleep(0.02)
        args = ["top", "--once", "--queue", queue_name, "--redis-url", redis_url]
        result = await asyncio.to_thread(CliRunner().invoke, app, args)
        for handle in handles:
            await handle.cancel()
    assert result.exit_code == 0, result.output
    out = result.output
    assert "\x1b[" not in out
    row = next(line for line in out.splitlines() if queue_name in line and "interactive" in line)
    cells = [cell.strip() for cell in row.strip("│ ").split("│")]
    assert cells[:2] == [queue_name, "interactive"]
    assert cells[3:5] == ["4", "1"]  # waiting, pending (length counts the dead one till trim)
    # jobs/s (none ended in the last interval) and tokens/s (50 a second, give or take one
    # token at either end of the interval)
    assert cells[6] == "0.0" and 30 <= float(cells[7]) <= 70, cells
    assert "test-worker-0" in out and "1/1" in out  # the worker, its load and capacity
    assert "invalid_request" in out


def test_top_refuses_a_bad_queue_name() -> None:
    result = CliRunner().invoke(app, ["top", "--once", "--queue", "no{pe}"])
    assert result.exit_code != 0
    assert "queue name" in result.output

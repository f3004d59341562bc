"""What one entry can cost: a worker holds at most one oversize entry whole, whatever it
has free slots for; the dead stream keeps a head of it, not the whole; and Redis set up as
deploy/redis/redis.conf refuses such an entry at XADD."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError

from exlq.protocol.keys import QueueKeys
from exlq.worker.embedded_redis import RedisServer
from tests.conftest import wait_until, worker_process
from tests.raw_events import raw_events

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
ENTRIES = 10
ENTRY_MB = 20


def _high_water_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"VmHWM:\s+(\d+) kB", status)
    assert match is not None
    return int(match.group(1)) / 1024


def _reset_high_water(pid: int) -> None:
    Path(f"/proc/{pid}/clear_refs").write_text("5")  # resets VmHWM to the current RSS


def _payload(job_id: str) -> bytes:
    return b'{"id":"%s","prompt":"' % job_id.encode() + b"x" * (ENTRY_MB << 20) + b'"}'


async def test_ten_oversize_entries_cost_the_worker_one_entry_and_the_dead_stream_a_head(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    worker = worker_process(
        redis_url,
        queue_name,
        "--engine",
        "echo",
        "--max-batch-size",
        "16",
        EXLQ_ENGINE_RUNNER="thread",  # one process: its memory is the worker's
    )
    keys = QueueKeys(queue_name)
    try:
        await _wait_for_heartbeat(redis_client, keys)
        _reset_high_water(worker.pid)
        before_mb = _high_water_mb(worker.pid)
        async with raw_events(redis_url) as recorder:
            ids = [f"big-{i}" for i in range(ENTRIES)]
            pipe = redis_client.pipeline(transaction=False)
            for job_id in ids:
                pipe.xadd(keys.jobs, {"job": _payload(job_id)})
            await pipe.execute()
            await wait_until(lambda: all(recorder.of(j) for j in ids), 30)
        peak_mb = _high_water_mb(worker.pid)
        dead_bytes = int(await redis_client.memory_usage(keys.dead) or 0)
        print(
            f"\n{ENTRIES} entries of {ENTRY_MB} MB: worker peak {before_mb:.0f} -> "
            f"{peak_mb:.0f} MB; dead stream {dead_bytes / 1024:.0f} KiB"
        )
        for job_id in ids:
            (event,) = recorder.of(job_id)
            assert event["type"] == "error" and event["error"]["code"] == "invalid_request"
            assert "EXLQ_MAX_REQUEST_BYTES" in event["error"]["message"]
        assert await redis_client.xlen(keys.dead) == ENTRIES
        # Ten entries' worth would be 200 MB; one entry's, with its copies, about 40.
        assert peak_mb - before_mb < 3 * ENTRY_MB
        assert dead_bytes < ENTRIES * 64 * 1024
    finally:
        worker.terminate()
        worker.communicate(timeout=30)


async def _wait_for_heartbeat(client: aioredis.Redis, keys: QueueKeys) -> None:
    async with asyncio.timeout(30):
        while not await client.hlen(keys.workers):
            await asyncio.sleep(0.05)


def _deploy_limit() -> str:
    conf = (ROOT / "deploy" / "redis" / "redis.conf").read_text()
    match = re.search(r"^proto-max-bulk-len\s+(\S+)", conf, re.MULTILINE)
    assert match is not None, "deploy/redis/redis.conf sets no proto-max-bulk-len"
    return match.group(1)


async def test_redis_set_up_as_deploy_refuses_an_oversize_entry_at_xadd() -> None:
    server = RedisServer(extra_args=["--proto-max-bulk-len", _deploy_limit()])
    server.start()
    client = aioredis.Redis.from_url(server.url)
    try:
        with pytest.raises((ResponseError, RedisConnectionError)):
            await client.xadd("exlq:{q}:jobs", {"job": _payload("too-big")})
        small = b'{"id":"fits","prompt":"' + b"x" * 900_000 + b'"}'
        await client.xadd("exlq:{q}:jobs", {"job": small})
        assert await client.xlen("exlq:{q}:jobs") == 1
    finally:
        await client.aclose()
        server.stop()

"""A job Redis has forgotten (a restart without persistence, a FLUSHALL) ends its handle's
wait with JobLost, at the reconnect or the next quiet poll; a job Redis still holds keeps
waiting, and a healthy stream reads nothing more for it."""

from __future__ import annotations

import asyncio
import math
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from exlq import AsyncProducer, JobHandle, JobLost, Producer
from exlq.producer.partition import QueuePartition
from exlq.protocol.models import JobResult
from exlq.worker.embedded_redis import RedisServer
from tests.conftest import ROOT

pytestmark = pytest.mark.integration

JOBS = 8
CHECK_S = 0.3  # WORKER_CHECK_S here: the first quiet check
POLL_S = 1.0  # RESULT_POLL_S where a test waits for the quiet poll


@pytest.fixture
def quiet_poll_s(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """Set the first quiet check to CHECK_S and the quiet poll to the seconds given."""
    monkeypatch.setattr("exlq.producer.client.WORKER_CHECK_S", CHECK_S)

    def set_poll(seconds: float) -> None:
        monkeypatch.setattr("exlq.producer.client.RESULT_POLL_S", seconds)

    return set_poll


@pytest.fixture
def state_reads(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The job ids whose stored result and state the SDK read."""
    reads: list[str] = []
    read = QueuePartition.result_and_state

    async def counted(self: QueuePartition, job_id: str) -> tuple[JobResult | None, bool]:
        reads.append(job_id)
        return await read(self, job_id)

    monkeypatch.setattr(QueuePartition, "result_and_state", counted)
    return reads


@pytest.fixture
def bare_redis() -> Iterator[RedisServer]:
    """A redis-server of this test alone, without persistence: no AOF, no RDB."""
    server = RedisServer().start()
    try:
        yield server
    finally:
        server.stop()


class _LossWatch:
    """Every handle's result() awaited from the start, as an application awaits it, so
    their quiet checks run from their submits; ``seconds()``: how long after ``mark()``
    (Redis has just lost the jobs) each raised JobLost."""

    def __init__(self, handles: list[JobHandle]) -> None:
        self._marked = math.inf  # a JobLost before the mark comes out as -inf
        self._tasks = [asyncio.create_task(self._one(h)) for h in handles]

    async def _one(self, handle: JobHandle) -> float:
        with pytest.raises(JobLost) as raised:
            await handle.result(timeout=30)
        assert raised.value.job_id == handle.id
        return time.monotonic() - self._marked

    def mark(self) -> None:
        self._marked = time.monotonic()

    async def seconds(self) -> list[float]:
        ends = await asyncio.gather(*self._tasks)
        assert min(ends) >= 0, "a handle raised JobLost before Redis lost its job"
        return ends


async def _submit_queued(producer: AsyncProducer) -> list[JobHandle]:
    return [await producer.submit(f"job {i}", max_new_tokens=4) for i in range(JOBS)]


def _waiting(tasks: list[asyncio.Task[Any]]) -> int:
    return sum(not t.done() for t in tasks)


def test_job_lost_is_an_sdk_error_that_says_what_to_do() -> None:
    message = str(JobLost("abc"))
    assert message.startswith("job abc is lost: Redis no longer holds its state or its result")
    assert "without persistence" in message and "flushed" in message and "expired" in message
    assert message.endswith("submit it again")


async def test_a_flushall_ends_every_waiting_handle_at_the_next_quiet_poll(
    redis_url: str,
    queue_name: str,
    redis_client: aioredis.Redis,
    quiet_poll_s: Callable[[float], None],
) -> None:
    quiet_poll_s(POLL_S)
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        watch = _LossWatch(await _submit_queued(producer))
        await asyncio.sleep(CHECK_S + 0.2)  # past the first quiet check: the polls decide
        await redis_client.flushall()  # the connections stay: no reconnect tells of it
        watch.mark()
        ends = await watch.seconds()
        print(f"\nFLUSHALL -> JobLost, {JOBS} handles, RESULT_POLL_S={POLL_S:g}: "
              f"{min(ends):.2f}-{max(ends):.2f}s")  # fmt: skip
        assert max(ends) <= POLL_S + 1.0
        assert producer._router.channel_count == 0  # the lost jobs' channels were left


async def test_a_flush_before_the_first_check_is_a_lost_job_not_a_silent_wait(
    redis_url: str,
    queue_name: str,
    redis_client: aioredis.Redis,
    quiet_poll_s: Callable[[float], None],
) -> None:
    # No worker, and no wait_for_worker: the first check finds no state to cancel. It
    # took that for a job started meanwhile, and waited on.
    quiet_poll_s(600.0)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        watch = _LossWatch(await _submit_queued(producer))
        await redis_client.flushall()
        watch.mark()
        ends = await watch.seconds()
        assert max(ends) <= CHECK_S + 1.0


async def test_a_restart_without_persistence_ends_every_handle_at_the_reconnect(
    bare_redis: RedisServer, quiet_poll_s: Callable[[float], None]
) -> None:
    quiet_poll_s(600.0)  # only the reconnect can tell
    async with AsyncProducer(bare_redis.url, queue="lost", wait_for_worker=True) as producer:
        watch = _LossWatch(await _submit_queued(producer))
        await asyncio.sleep(CHECK_S + 0.2)
        # In a thread: the SDK meets the outage as it happens, and reconnects after it.
        await asyncio.to_thread(bare_redis.kill)
        await asyncio.to_thread(bare_redis.start)  # empty, on the same port
        watch.mark()
        ends = await watch.seconds()
        print(f"\nrestart without persistence -> JobLost, {JOBS} handles: "
              f"{min(ends):.2f}-{max(ends):.2f}s after the server answered")  # fmt: skip
        assert max(ends) <= 3.0


def test_the_blocking_producer_raises_job_lost_too(
    redis_url: str, queue_name: str, quiet_poll_s: Callable[[float], None]
) -> None:
    quiet_poll_s(POLL_S)
    with Producer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        handle = producer.submit("lost", max_new_tokens=4)
        admin = redis.Redis.from_url(redis_url)
        admin.flushall()
        admin.close()
        with pytest.raises(JobLost, match=f"job {handle.id} is lost"):
            handle.result(timeout=10)


async def test_a_restart_that_kept_the_jobs_keeps_the_handles_waiting(
    tmp_path: Path, start_worker: Any, quiet_poll_s: Callable[[float], None]
) -> None:
    quiet_poll_s(0.3)
    server = RedisServer(data_dir=tmp_path / "redis").start()  # AOF: the jobs survive
    try:
        async with AsyncProducer(server.url, queue="kept", wait_for_worker=True) as producer:
            handles = await _submit_queued(producer)
            tasks = [asyncio.create_task(h.result(timeout=60)) for h in handles]
            await asyncio.sleep(CHECK_S + 0.2)
            server.stop()  # SIGTERM: Redis writes its AOF and exits
            server.start()
            await asyncio.sleep(2.0)  # the reconnect, then several quiet polls
            assert _waiting(tasks) == JOBS, [t.exception() for t in tasks if t.done()]
            await start_worker(redis_url=server.url, queue="kept")
            results = await asyncio.gather(*tasks)
        assert [r.text for r in results] == [f" job {i}" * 2 for i in range(JOBS)]
    finally:
        server.stop()


async def _event_connection_id(client: aioredis.Redis, name: str) -> str:
    held = [c for c in await client.client_list() if c["name"] == name and int(c["sub"]) > 0]
    assert len(held) == 1, held
    return str(held[0]["id"])


async def test_a_running_job_rides_out_a_dropped_event_connection(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
    state_reads: list[str],
) -> None:
    await start_worker(echo_tokens_per_second=20.0)
    url = f"{redis_url}?client_name=blip"
    async with AsyncProducer(url, queue=queue_name) as producer:
        handle = await producer.submit("blip", max_new_tokens=30)
        stream = handle.stream()
        await anext(stream)  # running
        await redis_client.client_kill_filter(_id=await _event_connection_id(redis_client, "blip"))
        events = [event async for event in stream]
        # The reconnect (and the gap it left) read the state: still there, so no JobLost.
        assert state_reads and set(state_reads) == {handle.id}
        assert events[-1].type == "done"
    result = await redis_client.get(producer.keys.result(handle.id))
    assert result is not None and JobResult.model_validate_json(result).text == " blip" * 30


async def test_a_healthy_stream_reads_no_stored_result_or_state(
    redis_url: str, queue_name: str, start_worker: Any, state_reads: list[str]
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        results = await asyncio.gather(
            *[(await producer.submit(f"ok {i}", max_new_tokens=8)).result(10) for i in range(4)]
        )
    assert [r.state for r in results] == ["done"] * 4
    assert state_reads == []


_JOB_LINE = re.compile(r"^job ([0-9a-f]{32})$")


def test_exlq_submit_says_the_job_is_lost_and_fails(bare_redis: RedisServer) -> None:
    command = [
        sys.executable, "-m", "exlq", "submit", "gone", "--queue", "lost",
        "--redis-url", bare_redis.url, "--wait-for-worker",
    ]  # fmt: skip
    cli = subprocess.Popen(command, cwd=ROOT, stderr=subprocess.PIPE, text=True)
    try:
        assert cli.stderr is not None
        found = _JOB_LINE.match(cli.stderr.readline().strip())
        assert found
        bare_redis.kill()
        bare_redis.start()
        _, stderr = cli.communicate(timeout=30)
    finally:
        if cli.poll() is None:
            cli.kill()
            cli.communicate()
    assert cli.returncode == 1
    assert f"error: job {found.group(1)} is lost: Redis no longer holds" in stderr
    assert "Traceback" not in stderr

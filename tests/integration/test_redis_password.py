"""A Redis that requires a password with URL-reserved characters: a worker, the SDK and the
`exlq submit` CLI reach it through EXLQ_REDIS_PASSWORD, given as written, with a URL that
holds none (as deploy/ sets them up: one Secret for KEDA and exlq alike)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator

import pytest
import redis

from exlq.producer.client import AsyncProducer
from exlq.protocol.redis_credentials import RedisCredentials
from exlq.worker.embedded_redis import RedisServer
from tests.conftest import ROOT, worker_process

pytestmark = pytest.mark.integration

PASSWORD = "p@ss:w/rd%"


class PasswordRedisServer(RedisServer):
    """A redis-server that asks every client for PASSWORD."""

    def __init__(self) -> None:
        super().__init__(extra_args=["--requirepass", PASSWORD])

    def ready_client(self) -> redis.Redis:
        return redis.Redis(port=self.port, password=PASSWORD, socket_connect_timeout=0.2)


@pytest.fixture
def locked_redis() -> Iterator[PasswordRedisServer]:
    with PasswordRedisServer() as server:
        yield server


@pytest.fixture
def worker(locked_redis: PasswordRedisServer, queue_name: str) -> Iterator[None]:
    process = worker_process(
        locked_redis.url, queue_name, "--engine", "echo", EXLQ_REDIS_PASSWORD=PASSWORD
    )
    try:
        yield
    finally:
        process.terminate()
        output, _ = process.communicate(timeout=30)
        assert PASSWORD not in output  # never logged
        assert "AUTH" not in output and "NOAUTH" not in output, output


def test_without_the_password_the_server_refuses(locked_redis: PasswordRedisServer) -> None:
    client = redis.Redis.from_url(locked_redis.url)
    try:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
    finally:
        client.close()


@pytest.mark.usefixtures("worker")
async def test_a_worker_and_the_sdk_reach_it_through_the_variable(
    locked_redis: PasswordRedisServer, queue_name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("EXLQ_REDIS_PASSWORD", PASSWORD)
    async with AsyncProducer(
        locked_redis.url, queue=queue_name, credentials=RedisCredentials(), wait_for_worker=True
    ) as producer:
        handle = await producer.submit("one two three", max_new_tokens=3)
        result = await handle.result(timeout=60)  # the worker ran it: it logged in too
    assert result.text


@pytest.mark.usefixtures("worker")
def test_the_submit_cli_reaches_it_through_the_variable(
    locked_redis: PasswordRedisServer, queue_name: str
) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "exlq", "submit", "hello there", "--queue", queue_name,
            "--redis-url", locked_redis.url, "--wait-for-worker", "--timeout", "60",
        ],
        cwd=ROOT,
        env={**os.environ, "EXLQ_REDIS_PASSWORD": PASSWORD},
        capture_output=True,
        text=True,
        timeout=90,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip()

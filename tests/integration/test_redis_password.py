"""A Redis that requires a password with URL-reserved characters: a worker, the SDK and the
`exlq submit` CLI reach it through EXLQ_REDIS_PASSWORD, given as written, with a URL that
holds none (as deploy/ sets them up: one Secret for KEDA and exlq alike)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from exlq.producer.client import AsyncProducer
from exlq.protocol.redis_credentials import RedisCredentials
from exlq.worker.embedded_redis import RedisServer, free_port
from tests.conftest import ROOT, worker_process

pytestmark = pytest.mark.integration

PASSWORD = "p@ss:w/rd%"


@pytest.fixture
def locked_redis() -> Iterator[RedisServer]:
    with RedisServer(password=PASSWORD) as server:
        yield server


@pytest.fixture
def worker(locked_redis: RedisServer, queue_name: str) -> Iterator[None]:
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


def test_without_the_password_the_server_refuses(locked_redis: RedisServer) -> None:
    client = redis.Redis.from_url(locked_redis.url)
    try:
        with pytest.raises(redis.AuthenticationError):
            client.ping()
    finally:
        client.close()


@pytest.mark.usefixtures("worker")
async def test_a_worker_and_the_sdk_reach_it_through_the_variable(
    locked_redis: RedisServer, queue_name: str, monkeypatch: pytest.MonkeyPatch
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
    locked_redis: RedisServer, queue_name: str
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


def test_up_asks_for_the_password_it_is_given(tmp_path: Path) -> None:
    """`exlq up` with EXLQ_REDIS_PASSWORD set starts a Redis that asks for it, so its worker
    and the submit command in the same environment log in, and nobody else gets in."""
    port = free_port()
    env = {**os.environ, "EXLQ_REDIS_PASSWORD": PASSWORD}
    url = f"redis://127.0.0.1:{port}/0"
    up = subprocess.Popen(
        [
            sys.executable, "-m", "exlq", "up", "--engine", "echo", "--queue", "demo",
            "--redis-port", str(port), "--data-dir", str(tmp_path), "--metrics-port", "0",
        ],
        cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert up.stdout is not None
        banner = "".join(up.stdout.readline() for _ in range(4))
        assert f"--redis-url {url}" in banner  # the URL shown holds no password
        done = subprocess.run(
            [
                sys.executable, "-m", "exlq", "submit", "locked up", "--queue", "demo",
                "--redis-url", url, "--max-new-tokens", "2", "--timeout", "20",
                "--wait-for-worker",
            ],
            cwd=ROOT, env=env, capture_output=True, text=True, timeout=60,
        )  # fmt: skip
        assert done.stdout == " locked up\n", done.stderr
        stranger = redis.Redis(port=port)
        try:
            with pytest.raises(redis.AuthenticationError):
                stranger.ping()
        finally:
            stranger.close()
        up.send_signal(signal.SIGINT)
        output, _ = up.communicate(timeout=30)
    finally:
        if up.poll() is None:
            up.kill()
            up.communicate()
    assert up.returncode == 0
    assert PASSWORD not in banner + output

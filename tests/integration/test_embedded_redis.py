"""The embedded redis-server never joins what already listens on its port: `exlq up`
fails with a message that says what holds the port and what to do."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from exlq.worker import embedded_redis
from exlq.worker.embedded_redis import PortTaken, RedisServer, free_port
from tests.conftest import ROOT

pytestmark = pytest.mark.integration


@pytest.fixture
def listener() -> Iterator[int]:
    """A port held by a program that is not Redis (it accepts, and says nothing)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        yield int(sock.getsockname()[1])


def test_a_port_held_by_another_program_is_refused(listener: int) -> None:
    server = RedisServer(port=listener)
    with pytest.raises(PortTaken, match=f"port {listener} on 127.0.0.1 is taken \\(in use\\)"):
        server.start()
    assert server.pid is None


def test_a_port_held_by_another_redis_is_refused_and_that_redis_left_alone(
    redis_server: RedisServer,
) -> None:
    with pytest.raises(PortTaken, match="a Redis server already answers there") as raised:
        RedisServer(port=redis_server.port).start()
    assert raised.value.redis_answers
    assert f"exlq worker --redis-url redis://127.0.0.1:{redis_server.port}/0" in str(raised.value)
    client = redis.Redis(port=redis_server.port)
    try:
        assert client.ping()
    finally:
        client.close()


def test_a_redis_that_took_the_port_after_the_check_is_found_by_its_process_id(
    redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The port was free when looked at; another server took it before ours bound it.
    monkeypatch.setattr(embedded_redis, "port_is_free", lambda port: True)
    server = RedisServer(port=redis_server.port)
    with pytest.raises(PortTaken):
        server.start()
    assert server.pid is None  # ours, which could not bind, is gone


def test_port_zero_takes_a_free_port() -> None:
    with RedisServer(port=0) as server:
        assert server.port != 0
        client = redis.Redis(port=server.port)
        try:
            info = client.info("server")
        finally:
            client.close()
        assert info["process_id"] == server.pid


def test_up_on_a_taken_port_fails_with_a_clear_message(
    redis_server: RedisServer, tmp_path: Path
) -> None:
    done = subprocess.run(
        [
            sys.executable, "-m", "exlq", "up", "--engine", "echo", "--queue", "demo",
            "--redis-port", str(redis_server.port), "--data-dir", str(tmp_path),
            "--metrics-port", "0",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert f"error: port {redis_server.port} on 127.0.0.1 is taken" in done.stderr
    assert "--redis-port" in done.stderr
    assert "Traceback" not in done.stderr
    assert "starting the worker" not in done.stdout
    assert free_port() != redis_server.port

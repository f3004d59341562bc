"""The embedded redis-server never joins what already listens on its port: `exlq up`
fails with a message that says what holds the port and what to do. `exlq up` starts a Redis
>= 7 found on PATH (it reports consumer-group lag), else the bundled 6.2, and says which."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

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


# ------------------------------------------------------------------ which server `up` starts


def _redis_7_on_path() -> str | None:
    """A redis-server >= 7 on PATH or in /usr/bin (Debian's: 7.0.15 on bookworm), if any."""
    for candidate in (shutil.which("redis-server"), "/usr/bin/redis-server"):
        if candidate and os.access(candidate, os.X_OK):
            version = embedded_redis.server_version(candidate)
            if version is not None and version >= embedded_redis.LAG_VERSION:
                return candidate
    return None


def _bin_dir_with(tmp_path: Path, programs: dict[str, str]) -> Path:
    """A folder holding executable scripts, one per name, each printing its text."""
    folder = tmp_path / "bin"
    folder.mkdir()
    for name, text in programs.items():
        script = folder / name
        script.write_text(f"#!/bin/sh\necho '{text}'\n")
        script.chmod(0o755)
    return folder


@contextlib.contextmanager
def _up(tmp_path: Path, path: str) -> Iterator[tuple[str, subprocess.Popen[str]]]:
    """`exlq up` with PATH = ``path`` (and no EXLQ_REDIS_SERVER); yields what it printed up
    to its Redis's URL, and the process; stops it at the end."""
    env = {k: v for k, v in os.environ.items() if k != "EXLQ_REDIS_SERVER"}
    env["PATH"] = path
    process = subprocess.Popen(
        [
            sys.executable, "-m", "exlq", "up", "--engine", "echo", "--queue", "demo",
            "--redis-port", "0", "--data-dir", str(tmp_path / "data"), "--metrics-port", "0",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )  # fmt: skip
    assert process.stdout is not None
    printed = []
    try:
        for line in process.stdout:  # ends when the process does: no wait without end
            printed.append(line)
            if "starting the worker" in line:
                break
        yield "".join(printed), process
    finally:
        process.terminate()
        process.wait(30)
        process.stdout.close()


def _server_info(printed: str) -> dict[str, Any]:
    found = re.search(r"Redis at (redis://127\.0\.0\.1:\d+/0)", printed)
    assert found, printed
    client = redis.Redis.from_url(found[1])
    try:
        info: dict[str, Any] = client.info("server")
        return info
    finally:
        client.close()


def test_up_starts_a_redis_7_found_on_path(tmp_path: Path) -> None:
    binary = _redis_7_on_path()
    if binary is None:
        pytest.skip("no redis-server >= 7 here (apt-get install redis-server)")
    path = f"{Path(binary).parent}{os.pathsep}{os.environ.get('PATH', '')}"
    with _up(tmp_path, path) as (printed, _process):
        info = _server_info(printed)
        assert str(info["redis_version"]).startswith(("7", "8"))
        assert "consumer-group lag is computed by exlq" not in printed
        assert f"({binary})" in printed


def test_up_without_redis_7_on_path_falls_back_to_the_bundled_one(tmp_path: Path) -> None:
    # A redis-server on PATH that is 6.x is passed over as well as a missing one.
    folder = _bin_dir_with(tmp_path, {"redis-server": "Redis server v=6.0.16 sha=0"})
    with _up(tmp_path, str(folder)) as (printed, _process):
        info = _server_info(printed)
        assert str(info["redis_version"]).startswith("6.2")
        assert "Redis 6.2" in printed
        assert "(bundled): consumer-group lag is computed by exlq" in printed


def test_choose_up_server_prefers_redis_7_then_valkey_then_the_bundled_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("EXLQ_REDIS_SERVER", raising=False)
    folder = _bin_dir_with(
        tmp_path,
        {
            "redis-server": "Redis server v=6.0.16 sha=0 malloc=jemalloc",
            "valkey-server": "Valkey server v=8.0.1 sha=00000000:0 malloc=jemalloc-5.3.0",
        },
    )
    monkeypatch.setenv("PATH", str(folder))
    chosen = embedded_redis.choose_up_server()
    assert (chosen.path, chosen.version) == (str(folder / "valkey-server"), (8, 0, 1))
    assert chosen.reports_lag

    (folder / "valkey-server").unlink()
    chosen = embedded_redis.choose_up_server()
    assert chosen.bundled and chosen.version is not None and chosen.version[:2] == (6, 2)
    assert chosen.describe().endswith("(bundled): consumer-group lag is computed by exlq")

    monkeypatch.setenv("EXLQ_REDIS_SERVER", str(folder / "redis-server"))
    assert embedded_redis.choose_up_server().path == str(folder / "redis-server")


def test_up_refuses_a_data_dir_of_redis_7_with_an_older_server(tmp_path: Path) -> None:
    (tmp_path / "data" / "redis" / "appendonlydir").mkdir(parents=True)
    done = subprocess.run(
        [
            sys.executable, "-m", "exlq", "up", "--engine", "echo", "--queue", "demo",
            "--redis-port", "0", "--data-dir", str(tmp_path / "data"), "--metrics-port", "0",
        ],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "EXLQ_REDIS_SERVER"} | {"PATH": ""},
        capture_output=True,
        text=True,
        timeout=60,
    )  # fmt: skip
    assert done.returncode == 2
    assert "cannot read: put a redis-server >= 7 on PATH" in done.stderr
    assert "Traceback" not in done.stderr

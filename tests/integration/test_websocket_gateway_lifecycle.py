"""exlq gateway websocket around its protocol: health answers for probes, a stop that
cancels the jobs in flight, and the command itself as a process."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import IO, Any, cast

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import connect
from websockets.exceptions import ConnectionClosed

from exlq.producer.gateways.exllamav2_ws.server import (
    WebSocketSettings,
    bound_port,
    running_gateway,
)
from exlq.protocol.keys import QueueKeys
from tests.conftest import ROOT
from tests.ws_tokenizer import make_tokenizer_folder

pytestmark = pytest.mark.integration


async def http_get(port: int, path: str) -> tuple[int, str]:
    """A plain HTTP/1.1 GET, as a probe sends it: the status and the body."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: probe\r\nConnection: close\r\n\r\n".encode())
        await writer.drain()
        async with asyncio.timeout(10):
            raw = await reader.read()
    finally:
        writer.close()
        await writer.wait_closed()
    head, _, body = raw.decode().partition("\r\n\r\n")
    return int(head.split()[1]), body


async def test_health_and_readiness(redis_url: str, queue_name: str) -> None:
    settings = WebSocketSettings(queue=queue_name, redis_url=redis_url, port=0)
    async with running_gateway(settings) as server:
        port = bound_port(server)
        assert await http_get(port, "/healthz") == (200, "ok\n")
        assert await http_get(port, "/readyz?probe=1") == (200, "ready\n")
        # Any other path is the WebSocket endpoint, as on exllamav2's server.
        async with connect(f"ws://127.0.0.1:{port}/any/path") as ws:
            await ws.send(json.dumps({"action": "echo"}))
            assert json.loads(await ws.recv()) == {"action": "echo"}


async def test_not_ready_without_redis(queue_name: str) -> None:
    # Port 1: nothing listens there.
    settings = WebSocketSettings(queue=queue_name, redis_url="redis://127.0.0.1:1/0", port=0)
    async with running_gateway(settings) as server:
        port = bound_port(server)
        status, body = await http_get(port, "/readyz")
        assert status == 503 and body.startswith("Redis: ")
        assert await http_get(port, "/healthz") == (200, "ok\n")


async def test_stopping_the_gateway_cancels_the_jobs_in_flight(
    redis_url: str,
    queue_name: str,
    start_worker: Any,
    redis_client: aioredis.Redis,
) -> None:
    await start_worker(echo_tokens_per_second=20.0)
    settings = WebSocketSettings(queue=queue_name, redis_url=redis_url, port=0)
    request = {"action": "infer", "text": "a b c", "max_new_tokens": 2000, "stream": True}
    async with running_gateway(settings) as server:
        ws = await connect(f"ws://127.0.0.1:{bound_port(server)}")
        await ws.send(json.dumps(request))
        assert json.loads(await ws.recv())["response_type"] == "chunk"
    # The server closed the connection going away (1001), and the job is cancelled.
    with pytest.raises(ConnectionClosed):
        while True:
            await ws.recv()
    assert ws.close_code == 1001
    keys = QueueKeys(queue_name)
    entries = cast("list[tuple[bytes, dict[bytes, bytes]]]", await redis_client.xrange(keys.jobs))
    job_id = json.loads(entries[0][1][b"job"])["id"]
    assert await redis_client.hget(keys.job(job_id), "state") == b"cancelled"


def gateway_process(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "exlq", "gateway", "websocket", *args],
        cwd=ROOT,
        env={**os.environ, "EXLQ_PORT": "0"},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def serving_line(output: IO[str]) -> str:
    """The gateway's line that says where it serves, read past the lines before it."""
    for line in output:
        if "serving exllamav2's WebSocket protocol on ws://127.0.0.1:" in line:
            return line
    raise AssertionError("the gateway ended without serving")


async def test_the_command_serves_until_sigterm(
    redis_url: str, queue_name: str, tmp_path: Path
) -> None:
    folder = make_tokenizer_folder(tmp_path / "model")
    process = gateway_process(
        "--queue", queue_name, "--redis-url", redis_url, "--tokenizer", str(folder)
    )
    try:
        assert process.stdout is not None
        line = await asyncio.wait_for(asyncio.to_thread(serving_line, process.stdout), 30)
        port = int(line.split("ws://127.0.0.1:")[1].split()[0])
        async with connect(f"ws://127.0.0.1:{port}") as ws:
            await ws.send(json.dumps({"action": "estimate_token", "text": "Hello world!"}))
            reply = json.loads(await ws.recv())
            assert reply["action"] == "estimate_token" and reply["num_tokens"] > 0
        process.send_signal(signal.SIGTERM)
        assert await asyncio.to_thread(process.wait, 30) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


@pytest.mark.parametrize(
    ("args", "rc", "says"),
    [
        (["--tokenizer", "/nonexistent/model"], 2, "does not exist"),
        (["--tokenizer", "{empty}"], 1, "holds no tokenizer.json"),
        (["--queue", "bad name!"], 1, "is not valid"),
    ],
)
def test_the_command_refuses_bad_options(
    redis_url: str, tmp_path: Path, args: list[str], rc: int, says: str
) -> None:
    args = [a.replace("{empty}", str(tmp_path)) for a in args]
    base = ["--queue", "q", "--redis-url", redis_url]
    process = gateway_process(*base, *args)
    out, _ = process.communicate(timeout=30)
    assert process.returncode == rc, out
    assert says in out


def test_the_command_says_when_its_port_is_taken(redis_url: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        process = gateway_process("--queue", "q", "--redis-url", redis_url, "--port", port)
        out, _ = process.communicate(timeout=30)
    assert process.returncode == 1, out
    assert f"cannot listen on 127.0.0.1:{port}" in out

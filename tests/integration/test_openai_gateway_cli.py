"""`exlq gateway openai` as a real process: it serves, its access log never shows an API key,
and it stops in one line (exit 2) when Redis cannot be reached."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx2
import pytest

from tests.conftest import ROOT

pytestmark = pytest.mark.integration

KEY = "sk-never-in-the-log-4242"


def _gateway(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "exlq", "gateway", "openai", *args],
        cwd=ROOT,
        env={k: v for k, v in os.environ.items() if not k.startswith("EXLQ_")},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port: int = probe.getsockname()[1]
        return port


def test_unreachable_redis_is_one_line_and_exit_2() -> None:
    process = _gateway("--redis-url", f"redis://127.0.0.1:{_free_port()}/0")
    output, _ = process.communicate(timeout=60)
    assert process.returncode == 2
    lines = output.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: cannot reach Redis at redis://")


def test_the_gateway_serves_and_logs_no_key(redis_url: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n")
    port = _free_port()
    args = ["--redis-url", redis_url, "--port", str(port), "--api-keys-file", str(keys)]
    process = _gateway(*args, "--log-level", "info")
    try:
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        with httpx2.Client() as http:
            while True:
                try:
                    if http.get(f"{base}/healthz").status_code == 200:
                        break
                except httpx2.TransportError:
                    pass
                assert process.poll() is None and time.monotonic() < deadline
                time.sleep(0.1)
            answered = http.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {KEY}"})
            refused = http.get(f"{base}/v1/models", headers={"Authorization": "Bearer nope"})
    finally:
        process.send_signal(signal.SIGTERM)
        output, _ = process.communicate(timeout=30)
    assert answered.status_code == 200 and answered.json() == {"object": "list", "data": []}
    assert refused.status_code == 401
    assert '"GET /v1/models HTTP/1.1" 200' in output
    assert '"GET /v1/models HTTP/1.1" 401' in output
    assert KEY not in output and "nope" not in output


def _started(base: str, process: subprocess.Popen[str]) -> None:
    deadline = time.monotonic() + 30
    with httpx2.Client() as http:
        while True:
            try:
                if http.get(f"{base}/healthz").status_code == 200:
                    return
            except httpx2.TransportError:
                pass
            assert process.poll() is None and time.monotonic() < deadline
            time.sleep(0.1)


async def test_sigterm_lets_an_open_stream_finish(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    """A rolling restart: SIGTERM mid-stream, and the stream still runs to its end and
    [DONE]; then the process ends (uvicorn, its shutdown done, raises the signal it caught
    again, so the exit status says SIGTERM)."""
    await start_worker(echo_tokens_per_second=20.0)
    port = _free_port()
    process = _gateway("--redis-url", redis_url, "--port", str(port), "--grace-seconds", "20")
    base = f"http://127.0.0.1:{port}"
    try:
        await asyncio.to_thread(_started, base, process)
        body = {
            "model": queue_name,
            "stream": True,
            "max_tokens": 20,
            "messages": [{"role": "user", "content": "a rolling restart"}],
        }
        events: list[str] = []
        async with (
            httpx2.AsyncClient(timeout=30) as http,
            http.stream("POST", f"{base}/v1/chat/completions", json=body) as response,
        ):
            async for line in response.aiter_lines():
                if not line.startswith("data: "):
                    continue
                events.append(line.removeprefix("data: "))
                if len(events) == 3:
                    process.send_signal(signal.SIGTERM)
        code = await asyncio.to_thread(process.wait, 30)
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate(timeout=30)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks)
    assert len(text.split()) == 20
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"
    assert code == -signal.SIGTERM

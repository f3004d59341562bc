"""`exlq gateway openai` as a real process: it serves, its access log never shows an API key,
and it stops in one line (exit 2) when Redis cannot be reached."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

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

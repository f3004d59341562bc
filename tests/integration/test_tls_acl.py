"""Producer and worker over TLS (rediss://) as the least-privileged ACL users of
docs/SECURITY.md, against a real redis-server built with TLS (tests/tls_redis.py)."""

from __future__ import annotations

import asyncio
import gc
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
from redis.exceptions import AuthenticationError, NoPermissionError

from exlq.producer import AsyncProducer
from exlq.protocol.keys import partition_of
from exlq.protocol.models import TokenEvent
from tests.tls_redis import (
    AclUser,
    TlsRedisServer,
    find_tls_redis_server,
    producer_rules,
    worker_rules,
)

pytestmark = pytest.mark.integration

QUEUE = "tlsq"
OTHER = "otherq"
ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def producer_user() -> AclUser:
    return AclUser.make(f"producer-{QUEUE}", producer_rules(QUEUE))


@pytest.fixture(scope="module")
def worker_user() -> AclUser:
    return AclUser.make(f"worker-{QUEUE}", worker_rules(QUEUE))


@pytest.fixture(scope="module")
def tls_server(producer_user: AclUser, worker_user: AclUser) -> Iterator[TlsRedisServer]:
    binary = find_tls_redis_server()
    if binary is None:
        pytest.skip(
            "no redis-server built with TLS: `bash .ci/run --install-tls-redis` installs "
            "Debian's, or set EXLQ_TLS_REDIS_SERVER to one"
        )
    with TlsRedisServer([producer_user, worker_user], binary) as server:
        yield server


@pytest.fixture
def admin(tls_server: TlsRedisServer) -> Iterator[redis.Redis]:
    client = tls_server.admin_client()
    yield client
    client.flushall()
    client.close()


# conftest's start_worker builds its workers from these two fixtures: here they name the
# TLS server, as the worker ACL user, and the queue that user may serve.
@pytest.fixture
def redis_url(tls_server: TlsRedisServer, worker_user: AclUser, admin: redis.Redis) -> str:
    return tls_server.user_url(worker_user)


@pytest.fixture
def queue_name() -> str:
    return QUEUE


@pytest.fixture
def producer_url(tls_server: TlsRedisServer, producer_user: AclUser) -> str:
    return tls_server.user_url(producer_user)


@pytest.fixture
def producer_client(producer_url: str) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(producer_url, socket_connect_timeout=2)
    yield client
    client.close()


def test_urls_carry_the_ca_file(tls_server: TlsRedisServer, producer_user: AclUser) -> None:
    url = tls_server.user_url(producer_user)
    assert url.startswith("rediss://")
    assert f"ssl_ca_certs={tls_server.ca_path}" in url


async def test_worker_serves_a_producer_over_tls(
    start_worker: Callable[..., Any], producer_url: str
) -> None:
    await start_worker()
    async with AsyncProducer(producer_url, queue=QUEUE) as producer:
        handle = await producer.submit("over tls", max_new_tokens=4)
        result = await handle.result(timeout=30)
        status = await producer.status(handle.id)
        batch = await producer.submit("batch lane", max_new_tokens=2, priority="batch")
        batch_result = await batch.result(timeout=30)
    assert result.text.split() == ["over", "tls", "over", "tls"]
    assert result.finish_reason == "length"
    assert status is not None
    assert status.state == "done"
    assert batch_result.text.split() == ["batch", "lane"]


async def test_producer_cancels_over_tls(
    start_worker: Callable[..., Any], producer_url: str
) -> None:
    await start_worker(echo_tokens_per_second=50.0)
    async with AsyncProducer(producer_url, queue=QUEUE) as producer:
        handle = await producer.submit("slow words", max_new_tokens=5000)
        async for event in handle.stream():
            if isinstance(event, TokenEvent):
                break
        assert await handle.cancel() == "running"
        result = await handle.result(timeout=30)
    assert result.finish_reason == "cancelled"


REFUSED_TO_PRODUCER: dict[str, Callable[[redis.Redis], object]] = {
    "GET another queue's result": lambda c: c.get(f"exlq:{{{OTHER}}}:result:x"),
    "XRANGE another queue's stream": lambda c: c.xrange(f"exlq:{{{OTHER}}}:jobs"),
    "XLEN another queue's stream": lambda c: c.xlen(f"exlq:{{{OTHER}}}:jobs"),
    "HGETALL another queue's job": lambda c: c.hgetall(f"exlq:{{{OTHER}}}:job:x"),
    "DEL its own stream": lambda c: c.delete(f"exlq:{{{QUEUE}}}:jobs"),
    "UNLINK its own stream": lambda c: c.unlink(f"exlq:{{{QUEUE}}}:jobs"),
    "XTRIM its own stream": lambda c: c.xtrim(f"exlq:{{{QUEUE}}}:jobs", maxlen=0),
    "XDEL from its own stream": lambda c: c.xdel(f"exlq:{{{QUEUE}}}:jobs", "1-0"),
    "XRANGE its own stream": lambda c: c.xrange(f"exlq:{{{QUEUE}}}:jobs"),
    "SET its own result": lambda c: c.set(f"exlq:{{{QUEUE}}}:result:x", "{}"),
    "PUBLISH a fake job event": lambda c: c.publish("exlq:out:{x}", "{}"),
    "PUBLISH another queue's cancel": lambda c: c.publish(f"exlq:{{{OTHER}}}:cancel", "x"),
    "FLUSHALL": lambda c: c.flushall(),
    "KEYS": lambda c: c.keys("*"),
    "CONFIG GET": lambda c: c.config_get("*"),
    "EVAL of its own script": lambda c: c.eval("return 1", 0),
}


@pytest.mark.parametrize("name", list(REFUSED_TO_PRODUCER))
def test_producer_is_refused(name: str, producer_client: redis.Redis, admin: redis.Redis) -> None:
    admin.set(f"exlq:{{{OTHER}}}:result:x", "{}")
    admin.xadd(f"exlq:{{{OTHER}}}:jobs", {"job": "{}"})
    admin.xadd(f"exlq:{{{QUEUE}}}:jobs", {"job": "{}"})
    with pytest.raises(NoPermissionError):
        REFUSED_TO_PRODUCER[name](producer_client)
    assert admin.xlen(f"exlq:{{{QUEUE}}}:jobs") == 1
    assert admin.exists(f"exlq:{{{OTHER}}}:result:x") == 1


def test_producer_may_publish_its_own_queue_cancel(producer_client: redis.Redis) -> None:
    assert producer_client.publish(f"exlq:{{{QUEUE}}}:cancel", "x") == 0


async def test_producer_cannot_submit_to_another_queue(producer_url: str) -> None:
    async with AsyncProducer(producer_url, queue=OTHER) as producer:
        with pytest.raises(NoPermissionError):
            await producer.submit("not yours", max_new_tokens=1)


def test_worker_may_send_every_command_of_the_broker(
    tls_server: TlsRedisServer, worker_user: AclUser
) -> None:
    """The commands worker/broker.py sends, and those its next version adds, one by one."""
    client = redis.Redis.from_url(tls_server.user_url(worker_user))
    base = f"exlq:{{{QUEUE}}}"
    jobs, job, workers = f"{base}:jobs", f"{base}:job:a", f"{base}:workers"
    try:
        client.ping()
        client.time()
        client.xgroup_create(jobs, "workers", id="0", mkstream=True)
        entry = cast("bytes", client.xadd(jobs, {"job": "{}"}))
        assert client.xreadgroup("workers", "w1", {jobs: ">"}, count=1)
        client.hset(job, mapping={"state": "running"})
        client.hincrby(job, "attempts", 1)
        client.hmget(job, ["state", "cancel"])
        client.xpending_range(jobs, "workers", min="-", max="+", count=10, consumername="w1")
        client.xclaim(jobs, "workers", "w1", 0, [entry], justid=True)
        client.xautoclaim(jobs, "workers", "w2", 0, "0-0", count=1)
        client.xinfo_groups(jobs)
        client.xinfo_consumers(jobs, "workers")
        pipe = client.pipeline(transaction=True)
        pipe.set(f"exlq:{{{QUEUE}}}:result:a", "{}", ex=60)
        pipe.hset(job, mapping={"state": "done"})
        pipe.expire(job, 60)
        pipe.publish("exlq:out:{a}", "{}")
        pipe.xadd(f"exlq:{{{QUEUE}}}:dead", {"entry": "x"}, maxlen=10, approximate=True)
        pipe.xack(jobs, "workers", entry)
        pipe.execute()
        client.xtrim(jobs, minid=entry)
        client.xgroup_delconsumer(jobs, "workers", "w2")
        client.hset(workers, "w1", "{}")
        client.expire(workers, 60)
        client.hgetall(workers)
        client.hdel(workers, "w1")
        assert client.register_script("return redis.call('HGET', KEYS[1], 'state')")(keys=[job])
        for refused in (
            lambda: client.get(f"exlq:{{{OTHER}}}:result:x"),
            lambda: client.delete(jobs),
            lambda: client.flushall(),
            lambda: client.publish(f"exlq:{{{OTHER}}}:cancel", "x"),
        ):
            with pytest.raises(NoPermissionError):
                refused()
    finally:
        client.close()


def test_plain_connection_to_the_tls_port_fails(
    tls_server: TlsRedisServer, producer_user: AclUser
) -> None:
    url = tls_server.user_url(producer_user, ca=False).replace("rediss://", "redis://", 1)
    client = redis.Redis.from_url(url, socket_timeout=5, socket_connect_timeout=5)
    try:
        with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
            client.ping()
    finally:
        client.close()


def test_server_certificate_is_verified(tls_server: TlsRedisServer, producer_user: AclUser) -> None:
    client = redis.Redis.from_url(tls_server.user_url(producer_user, ca=False), socket_timeout=5)
    try:
        with pytest.raises(redis.ConnectionError, match="CERTIFICATE_VERIFY_FAILED"):
            client.ping()
    finally:
        client.close()


async def test_wrong_password_is_refused(
    tls_server: TlsRedisServer, producer_user: AclUser
) -> None:
    client = redis.Redis.from_url(tls_server.user_url(producer_user, "wrong"))
    try:
        with pytest.raises(AuthenticationError, match="invalid username-password pair"):
            client.ping()
    finally:
        client.close()
    async with AsyncProducer(tls_server.user_url(producer_user, "wrong"), queue=QUEUE) as producer:
        with pytest.raises(AuthenticationError, match="invalid username-password pair"):
            await producer.submit("x", max_new_tokens=1)
    # redis-py drops a connection whose AUTH is refused without waiting for its TLS close,
    # which takes a reply from Redis. The refused producer leaves no socket open once that
    # reply is in; the test waits for it, so that its event loop does not close first.
    async with asyncio.timeout(10):
        while _open_sockets_to(tls_server.port):
            await asyncio.sleep(0.01)


def _open_sockets_to(port: int) -> list[asyncio.Transport]:
    """This process's asyncio transports whose socket to 127.0.0.1:``port`` is open."""
    found = []
    for item in gc.get_objects():
        # type(), not isinstance(): isinstance asks an object's __class__, and some objects
        # of other libraries the process has loaded warn when asked (torch's reduce_op).
        if issubclass(type(item), asyncio.Transport):
            sock, peer = item.get_extra_info("socket"), item.get_extra_info("peername")
            if sock is not None and peer and peer[1] == port and sock.fileno() != -1:
                found.append(item)
    return found


def test_default_user_is_off(tls_server: TlsRedisServer) -> None:
    client = redis.Redis(
        host="127.0.0.1", port=tls_server.port, ssl=True, ssl_ca_certs=str(tls_server.ca_path)
    )
    try:
        with pytest.raises(AuthenticationError):
            client.ping()
    finally:
        client.close()


def _doc_rules(kind: str, user: str) -> list[str]:
    """The rules docs/SECURITY.md gives ``user`` in its aclfile or ACL SETUSER form."""
    text = (ROOT / "docs" / "SECURITY.md").read_text()
    head = {"aclfile": rf"^user {re.escape(user)} ", "setuser": rf"^ACL SETUSER {re.escape(user)} "}
    lines = [line for line in text.splitlines() if re.match(head[kind], line)]
    assert len(lines) == 1, f"docs/SECURITY.md: expected one {kind} line for {user}"
    words = lines[0].split()
    start = words.index("on") + 2  # after "on" and ">password"
    return words[start:]


@pytest.mark.parametrize("kind", ["aclfile", "setuser"])
def test_security_doc_gives_the_tested_rules(kind: str, admin: redis.Redis) -> None:
    for user, rules in (
        ("producer-demo", producer_rules("demo")),
        ("worker-demo", worker_rules("demo")),
    ):
        documented = _doc_rules(kind, user)
        assert " ".join(documented) == " ".join(rules)
        # Redis takes the documented words as they are (a selector's parts joined again).
        setuser = ("ACL", "SETUSER", f"doc-{user}", "on", ">x", *documented)
        assert admin.execute_command(*setuser)  # type: ignore[no-untyped-call]


async def test_a_queue_in_partitions_is_served_within_the_rules(
    start_worker: Callable[..., Any], producer_url: str
) -> None:
    await start_worker(partitions=3)
    async with AsyncProducer(producer_url, queue=QUEUE) as producer:
        handles = [
            await producer.submit(f"part {i}", id=f"acl-{i}", max_new_tokens=2) for i in range(9)
        ]
        results = [await handle.result(timeout=30) for handle in handles]
        assert {partition_of(h.id, 3) for h in handles} == {0, 1, 2}
        assert await producer.cancel(handles[0].id) == "done"
    assert [r.text.split() for r in results] == [["part", str(i)] for i in range(9)]

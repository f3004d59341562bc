"""`exlq exporter` against a real redis-server: a backlog with no worker is visible (and the
shipped "no live worker" alert fires on it, as promtool evaluates it), a worker drains it,
a Redis that is down or silent gives redis_up 0 within the scrape timeout; and the waiting
count the Lua path computes (Redis 6.2) equals the lag Redis 7 keeps."""

from __future__ import annotations

import asyncio
import shutil
import socket
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis.asyncio as aioredis
from prometheus_client.parser import text_string_to_metric_families

from exlq.ops.exporter import Exporter
from exlq.ops.queue_stats import QueueReader
from exlq.producer import AsyncProducer
from exlq.protocol.keys import CONSUMER_GROUP, LANES, QueueKeys
from exlq.protocol.slot_routing import SlotClients
from exlq.worker.embedded_redis import RedisServer, free_port
from tests.conftest import worker_process
from tests.monitoring import Sample, assert_alert_fires_for, family, names_used

pytestmark = pytest.mark.integration

Samples = dict[str, list[tuple[dict[str, str], float]]]


def _get(url: str) -> tuple[int, str]:
    with urllib.request.urlopen(url, timeout=10) as reply:
        return reply.status, reply.read().decode()


async def scrape(port: int) -> Samples:
    status, text = await asyncio.to_thread(_get, f"http://127.0.0.1:{port}/metrics")
    assert status == 200
    samples: Samples = defaultdict(list)
    for metric in text_string_to_metric_families(text):
        for sample in metric.samples:
            samples[sample.name].append((sample.labels, sample.value))
    return samples


def value(samples: Samples, name: str, **labels: str) -> float:
    """The sum of ``name``'s samples whose labels include ``labels``."""
    found = [v for have, v in samples[name] if labels.items() <= have.items()]
    assert found, f"no {name}{labels}"
    return sum(found)


@pytest.fixture
async def serve_exporter() -> AsyncIterator[Callable[..., Any]]:
    """Start exporters on free ports; each is stopped at teardown."""
    running: list[tuple[asyncio.Event, asyncio.Task[None]]] = []

    async def start(redis_url: str, **options: Any) -> Exporter:
        exporter = Exporter(redis_url, "exlq", host="127.0.0.1", port=0, **options)
        stop = asyncio.Event()
        running.append((stop, asyncio.create_task(exporter.serve(stop))))
        return exporter

    yield start
    for stop, task in running:
        stop.set()
        await asyncio.wait_for(task, 10)


async def poll_scrape(
    port: int, until: Callable[[Samples], bool], timeout_s: float = 15
) -> Samples:
    async with asyncio.timeout(timeout_s):
        while True:
            samples = await scrape(port)
            if until(samples):
                return samples
            await asyncio.sleep(0.05)


@pytest.mark.cluster_too
async def test_a_backlog_without_workers_shows_and_a_worker_drains_it(
    redis_url: str, queue_name: str, start_worker: Any, serve_exporter: Any
) -> None:
    exporter = await serve_exporter(redis_url)
    async with AsyncProducer(redis_url, queue=queue_name, wait_for_worker=True) as producer:
        handles = [
            await producer.submit(
                f"job {i}", max_new_tokens=2, priority="batch" if i % 3 == 0 else "interactive"
            )
            for i in range(100)
        ]
        samples = await scrape(exporter.port)
        q = {"queue": queue_name}
        assert value(samples, "exlq_exporter_redis_up") == 1
        assert value(samples, "exlq_queue_waiting", **q) == 100
        assert value(samples, "exlq_queue_waiting", **q, lane="batch") == 34
        assert value(samples, "exlq_queue_length", **q) == 100
        assert value(samples, "exlq_queue_pending", **q) == 0
        assert value(samples, "exlq_queue_workers_live", **q) == 0
        assert value(samples, "exlq_queue_oldest_waiting_seconds", **q, lane="interactive") > 0
        assert value(samples, "exlq_queue_oldest_pending_seconds", **q) == 0
        assert value(samples, "exlq_exporter_scrape_duration_seconds") > 0

        running = await start_worker()
        results = await asyncio.gather(*(handle.result(timeout=30) for handle in handles))
        assert {result.state for result in results} == {"done"}

    def drained(samples: Samples) -> bool:
        return (
            value(samples, "exlq_queue_waiting", **q) == 0
            and value(samples, "exlq_queue_pending", **q) == 0
            and value(samples, "exlq_queue_workers_live", **q) == 1
        )

    samples = await poll_scrape(exporter.port, drained)
    assert value(samples, "exlq_queue_capacity", **q) == running.worker.capacity == 8
    assert value(samples, "exlq_queue_oldest_waiting_seconds", **q) == 0
    assert value(samples, "exlq_queue_dead_letters", **q) == 0


def _of_queue(samples: Samples, queue: str) -> list[Sample]:
    """The scrape's samples of ``queue``, and those of no queue (the exporter's own)."""
    return [
        (name, labels, v)
        for name, rows in samples.items()
        for labels, v in rows
        if labels.get("queue", queue) == queue
    ]


async def test_the_alert_rules_and_the_dashboard_work_on_live_series(
    redis_url: str, queue_name: str, serve_exporter: Any, tmp_path: Path
) -> None:
    """The shipped rules, evaluated by promtool on what `exlq exporter` and an `exlq worker`
    process serve: a backlog with no live worker is ExlqQueueUnserved, a served one is not;
    and every metric the dashboard and the rules ask for is in the two live scrapes."""
    exporter = await serve_exporter(redis_url)
    keys = QueueKeys(queue_name)
    client = aioredis.Redis.from_url(redis_url)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = [await producer.submit(f"job {i}", max_new_tokens=2) for i in range(100)]
        await client.xadd(keys.jobs, {"job": "not json"})  # a job that fails
        await client.aclose()
        unserved = _of_queue(await scrape(exporter.port), queue_name)
        metrics_port = free_port()
        worker = worker_process(
            redis_url, queue_name, "--engine", "echo", "--metrics-port", str(metrics_port)
        )
        try:
            await asyncio.gather(*(handle.result(timeout=60) for handle in handles))
            q = {"queue": queue_name}
            served = await poll_scrape(
                exporter.port,
                lambda s: (
                    value(s, "exlq_queue_workers_live", **q) == 1
                    and value(s, "exlq_queue_waiting", **q) + value(s, "exlq_queue_pending", **q)
                    == 0
                ),
            )
            _, worker_page = await asyncio.to_thread(
                _get, f"http://127.0.0.1:{metrics_port}/metrics"
            )
        finally:
            worker.terminate()
            worker.communicate(timeout=30)
    assert_alert_fires_for("ExlqQueueUnserved", unserved, {queue_name}, tmp_path)
    assert_alert_fires_for("ExlqQueueUnserved", _of_queue(served, queue_name), set(), tmp_path)
    live = {family(name) for name in served}
    live |= {family(x.name) for f in text_string_to_metric_families(worker_page) for x in f.samples}
    assert names_used() - live == set()


async def test_a_queue_redis_refuses_to_read_hides_no_other(
    redis_url: str, queue_name: str, serve_exporter: Any, redis_client: aioredis.Redis
) -> None:
    broken = f"{queue_name}-broken"
    await redis_client.set(QueueKeys(broken).jobs, "not a stream")  # WRONGTYPE for XLEN
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        await producer.submit("one", max_new_tokens=1)
        exporter = await serve_exporter(redis_url, queues=[broken, queue_name])
        samples = await scrape(exporter.port)
    assert value(samples, "exlq_exporter_redis_up") == 1
    assert value(samples, "exlq_queue_waiting", queue=queue_name) == 1
    assert not [labels for labels, _ in samples["exlq_queue_waiting"] if labels["queue"] == broken]


async def test_a_queue_named_is_shown_before_it_has_keys(
    redis_url: str, serve_exporter: Any
) -> None:
    exporter = await serve_exporter(redis_url, queues=["nothing-yet"])
    samples = await scrape(exporter.port)
    assert value(samples, "exlq_queue_waiting", queue="nothing-yet") == 0
    assert value(samples, "exlq_queue_workers_live", queue="nothing-yet") == 0
    assert value(samples, "exlq_exporter_redis_up") == 1


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A port that accepts connections and never answers (a Redis that hangs)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(16)
        yield int(sock.getsockname()[1])


async def test_a_redis_that_is_down_or_silent_gives_redis_up_0(
    serve_exporter: Any, silent_port: int
) -> None:
    down = await serve_exporter(f"redis://127.0.0.1:{free_port()}/0")
    samples = await scrape(down.port)
    assert value(samples, "exlq_exporter_redis_up") == 0
    assert not samples["exlq_queue_waiting"]
    assert await asyncio.to_thread(_get, f"http://127.0.0.1:{down.port}/healthz") == (200, "ok\n")

    silent = await serve_exporter(f"redis://127.0.0.1:{silent_port}/0", scrape_timeout_s=0.5)
    started = time.monotonic()
    samples = await scrape(silent.port)
    assert value(samples, "exlq_exporter_redis_up") == 0
    assert time.monotonic() - started < 3


async def test_a_port_in_use_is_a_clear_error(redis_url: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen(1)
        with pytest.raises(OSError):
            Exporter(redis_url, "exlq", host="127.0.0.1", port=sock.getsockname()[1])


# -- the waiting count: Redis 7's lag against the Lua path's count -------------------------


async def _make_lanes(client: aioredis.Redis, keys: QueueKeys) -> None:
    """Lanes in the states a queue passes through: the batch lane has no group yet; the
    interactive one has entries read, acked, trimmed, pending and waiting, and one deleted
    (after which Redis 7 gives no lag and computes nothing)."""
    stream = keys.lane_jobs("interactive")
    for i in range(40):
        await client.xadd(stream, {"job": f"{i}"})
    await client.xadd(keys.lane_jobs("batch"), {"job": "b"})
    await client.xgroup_create(stream, CONSUMER_GROUP, id="0")
    read = await client.xreadgroup(CONSUMER_GROUP, "w", {stream: ">"}, count=25)
    ids = [entry_id for entry_id, _ in read[0][1]]
    await client.xack(stream, CONSUMER_GROUP, *ids[:5], *ids[12:20])
    await client.xtrim(stream, minid=ids[5], approximate=False)


async def _true_waiting(client: aioredis.Redis, stream: str) -> int:
    groups = await client.xinfo_groups(stream)
    last = groups[0]["last-delivered-id"].decode() if groups else "0-0"
    return len(await client.xrange(stream, f"({last}", "+"))


@pytest.mark.parametrize("binary", ["bundled", "/usr/bin/redis-server"])
async def test_the_counted_waiting_equals_redis_lag(binary: str, tmp_path: Any) -> None:
    if binary != "bundled" and not shutil.which(binary):
        pytest.skip(f"no {binary}")
    with RedisServer(binary=None if binary == "bundled" else binary) as server:
        client = aioredis.Redis.from_url(server.url)
        try:
            keys = QueueKeys("lagged")
            await _make_lanes(client, keys)
            given = await QueueReader(client, "exlq").read("lagged")
            counted = await QueueReader(client, "exlq", force_count=True).read("lagged")
            capped = await QueueReader(client, "exlq", force_count=True, count_cap=4).read("lagged")
            version = (await client.info("server"))["redis_version"]
            for lane, by_redis, by_count, by_capped in zip(
                LANES, given.lanes, counted.lanes, capped.lanes, strict=True
            ):
                truth = await _true_waiting(client, keys.lane_jobs(lane))
                assert by_redis.waiting == by_count.waiting == truth, (version, lane)
                assert by_count.waiting_exact
                assert by_capped.waiting >= truth
            interactive = given.lanes[0]
            assert (interactive.length, interactive.waiting, interactive.pending) == (35, 15, 12)
            assert capped.lanes[0].waiting_exact is False
            assert given.lanes[1].has_group is False and given.lanes[1].waiting == 1
            if version.startswith("7"):
                # Redis 7 kept the lag here; after a deletion inside the stream it keeps
                # none, and the count takes over.
                stream = keys.lane_jobs("interactive")
                tail = await client.xrevrange(stream, count=1)
                await client.xdel(stream, tail[0][0])
                assert (await client.xinfo_groups(stream))[0]["lag"] is None
                after = await QueueReader(client, "exlq").read("lagged")
                assert after.lanes[0].waiting == await _true_waiting(client, stream) == 14
        finally:
            await client.aclose()


@pytest.mark.cluster_too
async def test_discovery_finds_queues_by_their_streams_and_heartbeats(
    redis_client: aioredis.Redis,
) -> None:
    nodes = SlotClients(redis_client)  # on a cluster, each key through its slot's master
    await (await nodes.for_key("{a}")).xadd(QueueKeys("a").lane_jobs("batch"), {"job": "{}"})
    await (await nodes.for_key("{b.c:d}")).xadd(QueueKeys("b.c:d").jobs, {"job": "{}"})
    await (await nodes.for_key("{e}")).hset(QueueKeys("e").workers, "w", "{}")
    other = QueueKeys("other", prefix="x").jobs
    await (await nodes.for_key(other)).xadd(other, {"job": "{}"})
    await (await nodes.for_key("{f}")).set("exlq:{f}:job:1", "not a queue's stream")
    await nodes.aclose()
    reader = QueueReader(redis_client, "exlq")
    assert await reader.discover() == ["a", "b.c:d", "e"]
    await reader.clients.aclose()

"""`exlq exporter`: every queue's backlog as Prometheus metrics, read from Redis at scrape
time, so that a queue with no live worker (the case an alert must catch) still has series.

The HTTP server (prometheus_client's WSGI app, in a thread) asks the event loop, which owns
the Redis client, for a collection, and waits at most the scrape timeout: a scrape never
hangs on Redis, and a Redis that fails or is late yields ``exlq_exporter_redis_up 0``
instead of an error page. /healthz answers 200 whatever Redis does (the process is alive).

A queue split in partitions is one queue here, as producers and workers see it: its series
sum every partition's (queue_stats.QueueReader), and ``exlq_queue_partitions`` says how many
there are.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any
from wsgiref.simple_server import make_server

import redis.asyncio as aioredis
from prometheus_client import make_wsgi_app
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import ThreadingWSGIServer, _SilentHandler
from prometheus_client.registry import CollectorRegistry
from redis.exceptions import RedisError, ResponseError

from exlq.ops.queue_stats import QueueReader, QueueStats
from exlq.protocol.redis_credentials import RedisCredentials

if TYPE_CHECKING:
    from prometheus_client.registry import Collector
else:  # prometheus_client before 0.14 has no Collector base: a registry takes any collect()
    Collector = object

log = logging.getLogger(__name__)

DEFAULT_PORT = 9410
# How often the queue list under the prefix is scanned again (SCAN walks every key).
DISCOVER_EVERY_S = 30.0

_LANE_GAUGES: dict[str, str] = {
    "exlq_queue_length": "Entries in the lane's stream.",
    "exlq_queue_waiting": "Entries no worker has read yet (the consumer group's lag).",
    "exlq_queue_pending": "Entries read by a worker and not yet acknowledged.",
    "exlq_queue_oldest_waiting_seconds": "Age of the oldest waiting entry; 0 when none waits.",
    "exlq_queue_oldest_pending_seconds": "Age of the oldest pending entry; 0 when none is.",
}
_QUEUE_GAUGES: dict[str, str] = {
    "exlq_queue_dead_letters": "Entries in the queue's dead-letter stream.",
    "exlq_queue_workers_live": "Workers whose heartbeat is live.",
    "exlq_queue_capacity": "Batch slots of the live workers, together.",
    "exlq_queue_running": "Jobs the live workers hold, from their heartbeats.",
    "exlq_queue_partitions": "Partitions the queue is split in (1: not split).",
}


@dataclass
class QueueSource:
    """Which queues to read: the ones named, else every one under the prefix (rescanned
    every DISCOVER_EVERY_S)."""

    reader: QueueReader
    named: tuple[str, ...] = ()
    _found: tuple[str, ...] = ()
    _found_at: float = -DISCOVER_EVERY_S

    async def queues(self) -> tuple[str, ...]:
        if self.named:
            return self.named
        if time.monotonic() - self._found_at >= DISCOVER_EVERY_S:
            self._found = tuple(await self.reader.discover())
            self._found_at = time.monotonic()
        return self._found

    async def read(self) -> list[QueueStats]:
        """Each queue's stats. A queue whose keys Redis refuses to read (a key of another
        type under a queue's name) is left out and logged, so it hides no other queue; a
        Redis that fails altogether raises."""
        stats = []
        for queue in await self.queues():
            try:
                stats.append(await self.reader.read(queue))
            except ResponseError as exc:
                log.warning("queue %s left out: Redis refused to read it: %s", queue, exc)
        return stats


class QueueCollector(Collector):
    """A prometheus_client collector whose every collect() reads Redis through ``read``,
    a function that runs the read on the event loop and waits at most ``timeout_s``."""

    def __init__(self, read: Callable[[float], list[QueueStats]], timeout_s: float) -> None:
        self._read = read
        self.timeout_s = timeout_s

    def collect(self) -> Iterator[GaugeMetricFamily]:
        started = time.perf_counter()
        try:
            stats: list[QueueStats] | None = self._read(self.timeout_s)
        except (RedisError, OSError, TimeoutError, concurrent.futures.TimeoutError) as exc:
            log.warning("reading Redis failed: %s", exc or type(exc).__name__)
            stats = None
        if stats is not None:
            yield from queue_families(stats)
        yield GaugeMetricFamily(
            "exlq_exporter_redis_up",
            "1 if the last scrape read Redis, 0 if Redis failed or was too slow.",
            value=0 if stats is None else 1,
        )
        yield GaugeMetricFamily(
            "exlq_exporter_scrape_duration_seconds",
            "Wall time of the last collection.",
            value=time.perf_counter() - started,
        )

    def describe(self) -> Iterable[GaugeMetricFamily]:
        return []  # no read at registration time


def queue_families(stats: list[QueueStats]) -> Iterator[GaugeMetricFamily]:
    """The queue gauges of one collection."""
    lane_families = {
        name: GaugeMetricFamily(name, doc, labels=["queue", "lane"])
        for name, doc in _LANE_GAUGES.items()
    }
    per_queue = {
        name: GaugeMetricFamily(name, doc, labels=["queue"]) for name, doc in _QUEUE_GAUGES.items()
    }
    for queue in stats:
        for lane in queue.lanes:
            labels = [queue.queue, lane.lane]
            values: tuple[float, ...] = (
                lane.length,
                lane.waiting,
                lane.pending,
                lane.oldest_waiting_s,
                lane.oldest_pending_s,
            )
            for family, value in zip(lane_families.values(), values, strict=True):
                family.add_metric(labels, value)
        totals = (
            queue.dead_letters,
            len(queue.workers),
            queue.capacity,
            queue.running,
            queue.partitions,
        )
        for family, value in zip(per_queue.values(), totals, strict=True):
            family.add_metric([queue.queue], value)
    yield from lane_families.values()
    yield from per_queue.values()


def health_app(metrics: Any) -> Any:
    """The metrics WSGI app with /healthz answered 200 in front of it."""

    def app(environ: dict[str, Any], start_response: Any) -> Iterable[bytes]:
        if environ.get("PATH_INFO") == "/healthz":
            start_response("200 OK", [("Content-Type", "text/plain")])
            return [b"ok\n"]
        return metrics(environ, start_response)  # type: ignore[no-any-return]

    return app


class Exporter:
    """The HTTP server and the event loop's Redis reader, started and stopped together."""

    def __init__(
        self,
        redis_url: str,
        prefix: str,
        queues: Iterable[str] = (),
        *,
        host: str = "0.0.0.0",
        port: int = DEFAULT_PORT,
        scrape_timeout_s: float = 5.0,
    ) -> None:
        self.client = aioredis.Redis.from_url(
            redis_url, socket_timeout=scrape_timeout_s, socket_connect_timeout=scrape_timeout_s
        )
        RedisCredentials().apply_to(self.client.connection_pool)
        self.source = QueueSource(QueueReader(self.client, prefix), tuple(queues))
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(QueueCollector(self._read_from_thread, scrape_timeout_s))
        self.server = make_server(
            host,
            port,
            health_app(make_wsgi_app(self.registry)),
            ThreadingWSGIServer,
            handler_class=_SilentHandler,
        )
        self._loop: asyncio.AbstractEventLoop | None = None

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def _read_from_thread(self, timeout_s: float) -> list[QueueStats]:
        if self._loop is None:
            raise RedisError("the exporter is not running")
        future = asyncio.run_coroutine_threadsafe(self.source.read(), self._loop)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise

    async def serve(self, stop: asyncio.Event) -> None:
        """Serve until ``stop`` is set; the server thread answers, this loop reads Redis."""
        self._loop = asyncio.get_running_loop()
        thread = threading.Thread(target=self.server.serve_forever, name="exlq-exporter-http")
        thread.start()
        try:
            await stop.wait()
        finally:
            self.server.shutdown()
            await asyncio.to_thread(thread.join)
            self.server.server_close()
            self._loop = None
            await self.source.reader.clients.aclose()
            await self.client.aclose()


async def run_exporter(exporter: Exporter) -> None:
    """Serve until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    await exporter.serve(stop)

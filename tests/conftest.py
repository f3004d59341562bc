"""Shared fixtures: a real redis-server per test session (no disk), and worker factories."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import itertools
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis

from bench.local_cluster import LocalCluster, find_cluster_server
from exlq.protocol.keys import QueueKeys
from exlq.protocol.slot_routing import follow_slot
from exlq.worker.broker import Broker
from exlq.worker.embedded_redis import RedisServer
from exlq.worker.engine_loop import EngineLoop
from exlq.worker.engines.base import Engine
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.metrics import Metrics
from exlq.worker.partitions import with_partitions
from exlq.worker.runner import Worker
from exlq.worker.settings import WorkerSettings

ROOT = Path(__file__).resolve().parent.parent
_queue_numbers = itertools.count()


@pytest.fixture
def echo_bench_model(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A model folder the bench's harness can run the echo engine on (a vocabulary size
    for its prompts), the bench worker's log kept in tmp_path."""
    monkeypatch.setenv("EXLQ_BENCH_WORKER_LOG", str(tmp_path / "worker.log"))
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"vocab_size": 32000}))
    return model


@pytest.fixture(scope="session")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[LocalCluster]:
    """A real Redis Cluster of 3 masters and 3 replicas (bench/local_cluster.py)."""
    binary = find_cluster_server()
    if binary is None:
        pytest.fail(
            "the Redis Cluster tests need a redis-server >= 7: `bash .ci/run "
            "--install-tls-redis` installs Debian's, or set EXLQ_CLUSTER_REDIS_SERVER"
        )
    with LocalCluster(binary) as cluster:
        yield cluster


@pytest.fixture
def redis_url(request: pytest.FixtureRequest, redis_server: RedisServer) -> Iterator[str]:
    """A Redis to test on: one redis-server, or (for a test marked ``cluster_too``, run
    once on each) an ordinary URL of one node of the local Redis Cluster. Emptied after."""
    if getattr(request, "param", "single") == "cluster":
        cluster: LocalCluster = request.getfixturevalue("redis_cluster")
        cluster.wait_healthy()
        yield cluster.url
        cluster.flush()
        return
    yield redis_server.url
    client = redis.Redis.from_url(redis_server.url)
    client.flushall()
    client.close()


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test marked ``cluster_too`` runs on one redis-server and on a Redis Cluster."""
    marked = metafunc.definition.get_closest_marker("cluster_too") is not None
    if marked and "redis_url" in metafunc.fixturenames:
        metafunc.parametrize("redis_url", ["single", "cluster"], indirect=True)


@pytest.fixture
def queue_name() -> str:
    return f"q{next(_queue_numbers)}"


@pytest.fixture
async def redis_client(redis_url: str, queue_name: str) -> AsyncIterator[aioredis.Redis]:
    """A client of the test's Redis; on a cluster, of the node serving the test's queue."""
    client = aioredis.Redis.from_url(redis_url)
    follow_slot(client.connection_pool, QueueKeys(queue_name).jobs)
    yield client
    await client.aclose()


@dataclass
class RunningWorker:
    worker: Worker
    stop: asyncio.Event
    task: asyncio.Task[int]
    metrics: Metrics

    async def shutdown(self) -> int:
        self.stop.set()
        return await asyncio.wait_for(self.task, 30)


WorkerFactory = Callable[..., "asyncio.Future[RunningWorker]"]


@pytest.fixture
async def start_worker(redis_url: str, queue_name: str) -> AsyncIterator[Callable[..., Any]]:
    """Start in-process workers on the echo engine (or a given engine); stopped at teardown."""
    started: list[tuple[RunningWorker, Broker]] = []
    names = itertools.count()

    async def start(engine: Engine | None = None, **overrides: Any) -> RunningWorker:
        options: dict[str, Any] = {
            "engine": "echo",
            "redis_url": redis_url,
            "queue": queue_name,
            "consumer_name": f"test-worker-{next(names)}",
            "metrics_port": 0,
            "max_batch_size": 8,
            "grace_seconds": 10.0,
            "read_block_ms": 100,
        }
        options.update(overrides)
        tokens_per_second = options.pop("echo_tokens_per_second", 500.0)
        settings = WorkerSettings.load({"tokens_per_second": tokens_per_second}, **options)
        if engine is None:
            engine = EchoEngine(settings.serving.max_batch_size, tokens_per_second)
        redis = settings.broker
        broker = Broker.from_url(
            redis.redis_url,
            QueueKeys(settings.queue_name),
            redis.consumer_name,
            result_ttl_s=redis.result_ttl_seconds,
            dead_max_len=redis.dead_stream_max_len,
            max_entry_bytes=settings.limits.max_request_bytes,
        )
        broker = await with_partitions(broker, redis.partitions)
        metrics = Metrics(settings.queue_name)
        worker = Worker(settings, EngineLoop(engine), broker, metrics)
        stop = asyncio.Event()
        task = asyncio.create_task(worker.run(stop))
        running = RunningWorker(worker, stop, task, metrics)
        started.append((running, broker))
        await wait_until(lambda: worker.ready or task.done())
        return running

    yield start
    for running, broker in started:
        if not running.task.done():
            with contextlib.suppress(Exception):
                await running.shutdown()
        await running.worker.broker.close()  # with the partitions it took on since
        if running.worker.broker is not broker:
            await broker.close()


async def wait_until(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not condition():
            await asyncio.sleep(0.01)


def worker_process(redis_url: str, queue: str, *extra: str, **env: str) -> subprocess.Popen[str]:
    """`exlq worker` as a real process, for signal and CLI tests."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "exlq",
            "worker",
            "--redis-url",
            redis_url,
            "--queue",
            queue,
            "--metrics-port",
            "0",
            *extra,
        ],
        cwd=ROOT,
        env={**os.environ, **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


@pytest.fixture(autouse=True)
def _collect_after_each_test() -> Iterator[None]:
    """A full collection after every test, so that what a test left unclosed (a connection,
    a socket) fails that test, under filterwarnings = error, and not a later one that the
    collector happened to run in."""
    yield
    gc.collect()

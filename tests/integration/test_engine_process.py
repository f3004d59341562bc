"""The engine in a process of its own: serves like the thread runner; its death ends the worker."""

from __future__ import annotations

import asyncio
import os
import signal

import pytest

from producer import AsyncProducer
from producer.keys import QueueKeys
from worker.broker import Broker
from worker.engine_process import EngineProcess
from worker.engines.base import EngineSetup
from worker.metrics import Metrics
from worker.runner import EXIT_ENGINE_DEAD, Worker
from worker.settings import WorkerSettings

pytestmark = pytest.mark.integration


async def test_process_runner_serves_and_its_death_stops_the_worker(
    redis_url: str, queue_name: str
) -> None:
    settings = WorkerSettings(
        engine="echo",
        redis_url=redis_url,
        queue=queue_name,
        max_batch_size=4,
        echo_tokens_per_second=200,
        metrics_port=0,
    )
    engine = EngineProcess(settings)
    await asyncio.to_thread(engine.load)
    assert (engine.name, engine.capacity, engine.setup) == ("echo", 4, EngineSetup())
    broker = Broker.from_url(
        redis_url, QueueKeys(queue_name), "proc-worker", result_ttl_s=60, dead_max_len=100
    )
    worker = Worker(settings, engine, broker, Metrics(queue_name))
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with AsyncProducer(redis_url, queue=queue_name) as producer:
            result = await (await producer.submit("over a pipe", max_new_tokens=4)).result(
                timeout=20
            )
            assert result.text == " over a pipe over"
            running = await producer.submit("long job", max_new_tokens=5_000)
            await anext(running.stream())
            pid = engine._process.pid
            assert pid is not None
            os.kill(pid, signal.SIGKILL)
            assert await asyncio.wait_for(task, 30) == EXIT_ENGINE_DEAD
            status = await producer.status(running.id)
        # Not acknowledged: the job stays pending for another worker.
        assert status is not None and status.state == "running"
        pending = await broker.client.xpending(QueueKeys(queue_name).jobs, "workers")
        assert pending["pending"] == 1
    finally:
        stop.set()
        engine.close()
        await broker.close()

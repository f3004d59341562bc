"""The engine in a process of its own: serves like the thread runner; its death ends the worker."""

from __future__ import annotations

import asyncio
import os
import queue
import signal
import threading

import pytest

from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import GenerationRequest
from exlq.worker.broker import Broker
from exlq.worker.engine_loop import StepReport
from exlq.worker.engine_process import EngineProcess
from exlq.worker.engines.base import JobEnded
from exlq.worker.metrics import Metrics
from exlq.worker.runner import EXIT_ENGINE_DEAD, Worker
from exlq.worker.settings import WorkerSettings

pytestmark = pytest.mark.integration


def _echo_settings(
    redis_url: str = "redis://unused", queue: str = "q", tokens_per_second: float = 1_000
) -> WorkerSettings:
    return WorkerSettings.load(
        {"tokens_per_second": tokens_per_second},
        engine="echo",
        redis_url=redis_url,
        queue=queue,
        max_batch_size=4,
        metrics_port=0,
    )


async def test_process_runner_serves_and_its_death_stops_the_worker(
    redis_url: str, queue_name: str
) -> None:
    settings = _echo_settings(redis_url, queue_name, tokens_per_second=200)
    engine = EngineProcess(settings)
    await asyncio.to_thread(engine.load)
    assert (engine.name, engine.capacity, engine.info) == ("echo", 4, {})
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


async def test_a_worker_reads_the_reports_on_its_event_loop_and_stops_cleanly(
    redis_url: str, queue_name: str
) -> None:
    settings = _echo_settings(redis_url, queue_name)
    engine = EngineProcess(settings)
    await asyncio.to_thread(engine.load)
    broker = Broker.from_url(
        redis_url, QueueKeys(queue_name), "loop-reader", result_ttl_s=60, dead_max_len=100
    )
    worker = Worker(settings, engine, broker, Metrics(queue_name))
    sink_threads: set[int] = set()
    put = worker._reports.put_nowait

    def noting_put(report: StepReport) -> None:
        sink_threads.add(threading.get_ident())
        put(report)

    worker._reports.put_nowait = noting_put  # type: ignore[method-assign]
    stop = asyncio.Event()
    task = asyncio.create_task(worker.run(stop))
    try:
        async with AsyncProducer(redis_url, queue=queue_name) as producer:
            handles = [await producer.submit(f"job {i}", max_new_tokens=6) for i in range(3)]
            results = [await h.result(timeout=20) for h in handles]
        assert [r.text for r in results] == [f" job {i} job {i} job {i}" for i in range(3)]
        # No relay thread: every report reached the worker on its event loop's thread.
        assert sink_threads == {threading.get_ident()}
        assert not [t for t in threading.enumerate() if t.name == "exlq-engine-reports"]
        stop.set()
        # The engine's last message ("stopped") ends the reading: stop() does not wait out
        # its timeout, and the pipe is off the loop.
        assert await asyncio.wait_for(task, 20) == 0
        assert engine._reading_done.is_set() and engine._loop is None
        assert not engine._process.is_alive()
    finally:
        stop.set()
        engine.close()
        await broker.close()


def test_without_an_event_loop_a_relay_thread_hands_the_reports_on() -> None:
    engine = EngineProcess(_echo_settings())
    engine.load()
    reports: queue.SimpleQueue[tuple[int, StepReport]] = queue.SimpleQueue()
    engine.start(lambda r: reports.put((threading.get_ident(), r)))
    try:
        engine.add_many([("a", GenerationRequest(prompt="relayed", max_new_tokens=2))])
        outputs = []
        while not any(isinstance(o, JobEnded) for o in outputs):
            thread, report = reports.get(timeout=20)
            assert thread != threading.get_ident() and report.fatal is None
            outputs += report.outputs
        assert "".join(getattr(o, "text", "") for o in outputs) == " relayed relayed"
        engine.stop(20)
        assert engine._reader is not None and not engine._reader.is_alive()
    finally:
        engine.close()


async def test_a_command_larger_than_the_pipe_never_blocks_the_event_loop() -> None:
    engine = EngineProcess(_echo_settings(tokens_per_second=50))
    await asyncio.to_thread(engine.load)
    loop = asyncio.get_running_loop()
    reports: asyncio.Queue[StepReport] = asyncio.Queue()
    engine.start(reports.put_nowait, loop)
    try:
        # A job that keeps the engine stepping, then, with the engine process stopped (as
        # in a long step: it reads nothing), an offer of 3 MB of prompts, more than the
        # widened pipe holds.
        engine.add_many([("busy", GenerationRequest(prompt="busy", max_new_tokens=20))])
        await reports.get()
        big = [  # 1 MB of prompt each, each its own string (pickle writes a shared one once)
            (f"big-{i}", GenerationRequest(prompt=f"word{i} " * 170_000, max_new_tokens=2))
            for i in range(3)
        ]
        pid = engine.pid
        assert pid is not None
        os.kill(pid, signal.SIGSTOP)
        try:
            engine.offer(1, big)  # returns: the rest waits for the loop, not the caller
            engine.admit(1, [(job_id, None) for job_id, _ in big])
            assert engine._writer.pending_bytes > 0
        finally:
            os.kill(pid, signal.SIGCONT)
        ended: set[str] = set()
        while len(ended) < 4:
            report = await asyncio.wait_for(reports.get(), 30)
            assert report.fatal is None
            ended |= {o.job_id for o in report.outputs if isinstance(o, JobEnded)}
        assert ended == {"busy", "big-0", "big-1", "big-2"}
        assert engine._writer.pending_bytes == 0
        await asyncio.to_thread(engine.stop, 20)
    finally:
        engine.close()

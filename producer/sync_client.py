"""Producer: the blocking twin of AsyncProducer, for code without an event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from typing import Any, TypeVar

from exlq.producer.client import AsyncProducer, JobHandle
from exlq.producer.partition import JobStatus
from exlq.protocol.models import Event, GenerationRequest, JobResult

T = TypeVar("T")


class _LoopThread:
    """An event loop on a daemon thread that runs the async SDK for blocking callers."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self.loop.run_forever, name="exlq-producer", daemon=True
        )
        self._thread.start()

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result()

    def iterate(self, agen: AsyncIterator[T]) -> Iterator[T]:
        while True:
            try:
                yield self.run(_anext(agen))
            except StopAsyncIteration:
                return

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join()
        self.loop.close()


async def _anext(agen: AsyncIterator[T]) -> T:
    return await agen.__anext__()


class SyncJobHandle:
    def __init__(self, handle: JobHandle, runner: _LoopThread) -> None:
        self._handle = handle
        self._runner = runner
        self.id = handle.id
        self.duplicate = handle.duplicate

    def stream(self) -> Iterator[Event]:
        return self._runner.iterate(self._handle.stream())

    def stream_text(self) -> Iterator[str]:
        return self._runner.iterate(self._handle.stream_text())

    def result(self, timeout: float | None = None) -> JobResult:
        return self._runner.run(self._handle.result(timeout=timeout))

    def cancel(self) -> str:
        return self._runner.run(self._handle.cancel())


class Producer:
    """Blocking producer. Use as ``with Producer(url, queue=...) as p``."""

    def __init__(self, redis_url: str = "redis://localhost:6379/0", **options: Any) -> None:
        self._runner = _LoopThread()
        self._async = self._runner.run(_make(redis_url, options))

    def __enter__(self) -> Producer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._runner.run(self._async.close())
        self._runner.stop()

    def submit(
        self, prompt: str | None = None, *, request: GenerationRequest | None = None, **fields: Any
    ) -> SyncJobHandle:
        handle = self._runner.run(self._async.submit(prompt, request=request, **fields))
        return SyncJobHandle(handle, self._runner)

    def get_result(self, job_id: str) -> JobResult | None:
        return self._runner.run(self._async.get_result(job_id))

    def status(self, job_id: str) -> JobStatus | None:
        return self._runner.run(self._async.status(job_id))

    def cancel(self, job_id: str) -> str:
        return self._runner.run(self._async.cancel(job_id))


async def _make(redis_url: str, options: dict[str, Any]) -> AsyncProducer:
    # Built on the loop thread so that its connections belong to that loop.
    return AsyncProducer(redis_url, **options)

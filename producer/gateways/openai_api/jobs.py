"""A request's n jobs: submitted together, their events merged into one stream, and
cancelled when the client goes away.

Each job's events are read by a task of its own (a pump) that the runner keeps, not by the
request's task: a client that disconnects cancels the request's task, and a handle's
stream() cut off by a cancel would leave its channel subscribed. Instead the jobs are
cancelled and their pumps read on to the end the cancel brings (finish_reason cancelled),
which releases each subscription as a stream that ends does."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Coroutine
from typing import Any

from exlq.producer.client import JobHandle
from exlq.producer.errors import ExlqError, InvalidRequest
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.job_errors import error_from_sdk
from exlq.producer.gateways.openai_api.producers import ProducerPool
from exlq.producer.gateways.openai_api.translate import ParsedRequest
from exlq.protocol.models import Event

log = logging.getLogger(__name__)

# What a pump puts in its request's queue: an event, the exception that ended the stream,
# or None once the stream has ended.
_Item = tuple[int, Event | Exception | None]


class JobRunner:
    """Submits requests' jobs and keeps the tasks that may outlive a request."""

    def __init__(self, pool: ProducerPool) -> None:
        self._pool = pool
        self._tasks: set[asyncio.Task[Any]] = set()

    def keep(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._done)
        return task

    def _done(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.warning("a gateway task failed: %r", task.exception())

    async def submit(self, parsed: ParsedRequest, response_id: str) -> JobSet:
        """Submit the request's n jobs at once (one round trip to Redis); job i's id is
        ``<response id>-<i>``, so an operator can find a response's jobs. If any submit
        fails, the others are cancelled and its error raised."""
        producer = self._pool.producer(parsed.model)
        outcomes = await asyncio.gather(
            *(
                producer.submit(id=f"{response_id}-{index}", **fields)
                for index, fields in enumerate(parsed.job_fields())
            ),
            return_exceptions=True,
        )
        handles = [o for o in outcomes if isinstance(o, JobHandle)]
        failure = next((o for o in outcomes if isinstance(o, BaseException)), None)
        jobs = JobSet(self, handles, parsed.model)
        if failure is not None:
            jobs.abandon()
            if isinstance(failure, ExlqError | InvalidRequest):
                raise error_from_sdk(failure, parsed.model) from None
            raise failure
        return jobs

    async def close(self) -> None:
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


class JobSet:
    """The jobs of one request and their merged events."""

    def __init__(self, runner: JobRunner, handles: list[JobHandle], model: str) -> None:
        self.handles = handles
        self._runner = runner
        self._model = model
        self._queue: asyncio.Queue[_Item] = asyncio.Queue()
        self._abandoned = False
        self._pumps = [runner.keep(self._pump(i, h)) for i, h in enumerate(handles)]

    async def _pump(self, index: int, handle: JobHandle) -> None:
        try:
            async for event in handle.stream():
                if not self._abandoned:
                    self._queue.put_nowait((index, event))
        except Exception as exc:  # the request's task reports it
            self._queue.put_nowait((index, exc))
        finally:
            self._queue.put_nowait((index, None))

    async def events(self) -> AsyncIterator[tuple[int, Event]]:
        """(choice index, event) of every job, in the order they arrive, until each job's
        stream ends. An SDK error (the job lost, no worker) raises its OpenAIError."""
        streaming = len(self.handles)
        while streaming:
            index, item = await self._queue.get()
            if item is None:
                streaming -= 1
            elif isinstance(item, ExlqError):
                raise error_from_sdk(item, self._model)
            elif isinstance(item, Exception):
                log.error("job %s: its stream failed: %r", self.handles[index].id, item)
                raise OpenAIError(500, "the job's events could not be read", code="internal_error")
            else:
                yield index, item

    def abandon(self) -> None:
        """Nobody waits for the answer: cancel the jobs that have not ended. Synchronous, so
        that it runs in a finally of a task being cancelled."""
        if self._abandoned:
            return
        self._abandoned = True
        for handle, pump in zip(self.handles, self._pumps, strict=True):
            if not pump.done():
                self._runner.keep(handle.cancel())

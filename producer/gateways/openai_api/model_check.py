"""Is a model served? A model is a queue: known when Redis holds its jobs stream (a worker
makes it with the consumer group, and it outlives the workers) or its workers hash; served
when one of its workers sent a heartbeat within the stale time. Unknown -> 404, known but
served by no live worker -> 503.

Each answer holds for CACHE_S, so the hot path pays one Redis round trip per model per
CACHE_S, not one per request, and requests that ask at once share one read."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.job_errors import no_worker_error
from exlq.producer.gateways.openai_api.producers import ProducerPool
from exlq.protocol.heartbeat import live_times
from exlq.protocol.keys import check_name

CACHE_S = 1.0
# Answers kept at most, so that requests naming endless made-up models cost bounded memory.
MAX_CACHED = 4096


@dataclass(frozen=True, slots=True)
class ModelState:
    known: bool
    live_workers: int


class ModelCheck:
    def __init__(self, pool: ProducerPool) -> None:
        self._pool = pool
        self._answers: dict[str, tuple[float, asyncio.Task[ModelState]]] = {}

    async def state(self, model: str) -> ModelState:
        now = time.monotonic()
        held = self._answers.get(model)
        if held is None or held[0] <= now:
            if len(self._answers) >= MAX_CACHED:
                self._answers.clear()
            task = asyncio.ensure_future(self._read(model))
            held = self._answers[model] = (now + CACHE_S, task)
            task.add_done_callback(lambda done: self._forget_failed(model, done))
        # Shared by every request that asks meanwhile; one that is cancelled leaves it be.
        return await asyncio.shield(held[1])

    async def require_live(self, model: str) -> None:
        """Raise 404 for a model no queue has, 503 for one no live worker serves."""
        try:
            check_name("model", model)
        except ValueError:
            raise _not_found(model) from None
        state = await self.state(model)
        if not state.known:
            raise _not_found(model)
        if not state.live_workers:
            raise no_worker_error(model)

    async def _read(self, model: str) -> ModelState:
        keys = self._pool.keys(model)
        client = await self._pool.clients.for_key(keys.jobs)  # a cluster's: the queue's master
        pipe = client.pipeline(transaction=False)
        pipe.exists(keys.jobs, keys.workers)
        pipe.hvals(keys.workers)
        known, beats = await pipe.execute()
        live = live_times(beats, self._pool.worker_stale_after_s, time.time())
        return ModelState(bool(known), len(live))

    def _forget_failed(self, model: str, task: asyncio.Task[ModelState]) -> None:
        # A failed read (Redis away) is not held: the next request reads again.
        if task.cancelled() or task.exception() is not None:
            held = self._answers.get(model)
            if held is not None and held[1] is task:
                del self._answers[model]


def _not_found(model: str) -> OpenAIError:
    return OpenAIError(
        404,
        f"The model {model!r} does not exist: no exlq queue of that name is known.",
        code="model_not_found",
        param="model",
    )

"""A worker takes a piece in with Python's automatic collections held off, and turns them
back on once the piece is handed to its engine (worker/gc_pauses.py)."""

from __future__ import annotations

import asyncio
import gc
from typing import Any

import pytest

from exlq.producer import AsyncProducer
from exlq.worker.broker import Broker, StartDecision
from exlq.worker.engines.echo.engine import EchoEngine

pytestmark = pytest.mark.integration


async def test_no_collection_runs_while_a_piece_is_taken_in_and_after_it_can(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    real_start = Broker.start_jobs
    during_start: list[bool] = []

    async def start_jobs(self: Broker, jobs: list[tuple[str, str]]) -> list[StartDecision]:
        during_start.append(gc.isenabled())
        return await real_start(self, jobs)

    monkeypatch.setattr(Broker, "start_jobs", start_jobs)
    assert gc.isenabled()
    await start_worker(engine=EchoEngine(capacity=4, tokens_per_second=1000))
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handles = await asyncio.gather(
            *(producer.submit(f"job {i}", max_new_tokens=3) for i in range(3))
        )
        results = await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)), timeout=10)
    assert [r.state for r in results] == ["done"] * 3
    assert during_start and not any(during_start)
    assert gc.isenabled()

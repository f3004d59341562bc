"""A raw subscriber, as a producer without the SDK would run one (README, "Without the
SDK"): every event of every job, in the order they arrive, with no dedupe or reordering.
It reconnects when Redis goes away, so it also hears what comes after a restart."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError


class RawEvents:
    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.listening = asyncio.Event()

    def of(self, job_id: str) -> list[dict[str, Any]]:
        return [e for e in self.events if e["id"] == job_id]

    def repeats(self) -> dict[tuple[str, int, int], int]:
        """(id, attempt, seq) heard more than once, with how often."""
        heard = Counter((e["id"], e["attempt"], e["seq"]) for e in self.events)
        return {key: n for key, n in heard.items() if n > 1}

    def stale(self, job_id: str) -> list[dict[str, Any]]:
        """Events of an earlier attempt heard after a later attempt's first event."""
        newest, late = 0, []
        for event in self.of(job_id):
            if event["attempt"] < newest:
                late.append(event)
            newest = max(newest, event["attempt"])
        return late

    async def _listen(self, url: str, pattern: str) -> None:
        while True:
            client = aioredis.Redis.from_url(url)
            pubsub = client.pubsub()
            try:
                await pubsub.psubscribe(pattern)
                self.listening.set()
                async for message in pubsub.listen():
                    if message["type"] == "pmessage":
                        self.events.append(json.loads(message["data"]))
            except (RedisConnectionError, OSError):
                await asyncio.sleep(0.1)
            finally:
                await pubsub.aclose()  # type: ignore[no-untyped-call]
                await client.aclose()


@contextlib.asynccontextmanager
async def raw_events(url: str, pattern: str = "exlq:out:*") -> AsyncIterator[RawEvents]:
    recorder = RawEvents()
    task = asyncio.create_task(recorder._listen(url, pattern))
    await asyncio.wait_for(recorder.listening.wait(), 10)
    try:
        yield recorder
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)

"""What every step of the batch runner works with: the stores, the producers, the settings
and the clock, and the runner's view of one batch."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, cast

from exlq.producer.gateways.openai_api.batch_settings import BatchSettings
from exlq.producer.gateways.openai_api.batch_store import (
    ENDING,
    SUBMITTED,
    BatchStatus,
    BatchStore,
    Ending,
)
from exlq.producer.gateways.openai_api.file_store import FileStore
from exlq.producer.gateways.openai_api.producers import ProducerPool
from exlq.protocol.keys import Lane

# The lane a batch's jobs run on: workers give it the slots interactive requests leave.
BATCH_LANE: Lane = "batch"


@dataclass(frozen=True)
class BatchWork:
    pool: ProducerPool
    store: BatchStore
    files: FileStore
    settings: BatchSettings
    clock: Callable[[], float]

    def now(self) -> int:
        return int(self.clock())


@dataclass(frozen=True)
class Pending:
    """A line submitted and not yet finished: the queue of its jobs, and how many."""

    model: str
    jobs: int

    def encode(self) -> str:
        return json.dumps({"model": self.model, "jobs": self.jobs})

    @classmethod
    def decode(cls, raw: bytes) -> Pending:
        found = json.loads(raw)
        return cls(found["model"], int(found["jobs"]))


@dataclass(frozen=True)
class Batch:
    """The runner's view of a batch, read at the start of a step."""

    id: str
    status: BatchStatus
    endpoint: str
    input_file_id: str
    expires_at: int
    total: int
    submitted: int
    ending: Ending | None

    @classmethod
    def from_fields(cls, fields: dict[str, Any]) -> Batch:
        counts = fields.get("request_counts") or {}
        return cls(
            id=fields["id"],
            status=fields["status"],
            endpoint=fields["endpoint"],
            input_file_id=fields["input_file_id"],
            expires_at=int(fields["expires_at"]),
            total=int(counts.get("total", 0)),
            submitted=int(fields.get(SUBMITTED, 0)),
            ending=fields.get(ENDING),
        )


async def pending_lines(work: BatchWork, batch: Batch) -> dict[int, Pending]:
    raw = cast(
        "dict[bytes, bytes]", await work.store.redis.hgetall(work.store.keys.pending(batch.id))
    )
    return {int(line): Pending.decode(value) for line, value in raw.items()}


async def input_lines(work: BatchWork, batch: Batch, lines: list[int]) -> dict[int, bytes]:
    """The raw input lines of these line numbers."""
    if not lines:
        return {}
    found = await work.store.redis.hmget(work.store.keys.input(batch.id), [str(n) for n in lines])
    pairs = zip(lines, cast("list[bytes | None]", found), strict=True)
    return {line: raw for line, raw in pairs if raw is not None}

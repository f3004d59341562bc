"""Submitting a batch's lines as jobs on the batch lane, a chunk per step, in file order,
and within a bound of jobs in flight. A line whose body is refused ends at once in the error
file; a full queue stops the chunk there, to be tried again at the next step."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum
from typing import cast

from redis.typing import EncodableT, FieldT

from exlq.producer.client import JobHandle
from exlq.producer.errors import QueueFull
from exlq.producer.gateways.openai_api.batch_lines import (
    failed_line,
    job_id,
    parse_line_body,
    read_line,
)
from exlq.producer.gateways.openai_api.batch_store import SUBMITTED
from exlq.producer.gateways.openai_api.batch_work import (
    BATCH_LANE,
    Batch,
    BatchWork,
    Pending,
    forget,
)
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.translate import ParsedRequest
from exlq.protocol.models import InvalidRequest


class _Full(Enum):
    QUEUE_FULL = "queue full"


@dataclass(frozen=True)
class Submission:
    number: int
    custom_id: str
    parsed: ParsedRequest | None
    refusal: OpenAIError | None


def read_submission(batch: Batch, number: int, raw: bytes) -> Submission:
    custom_id, body = read_line(raw)
    try:
        return Submission(number, custom_id, parse_line_body(batch.endpoint, body), None)
    except OpenAIError as exc:
        return Submission(number, custom_id, None, exc)


async def submit_more(work: BatchWork, batch: Batch, in_flight_jobs: int) -> None:
    """Submits the next lines, as many as the in-flight bound leaves room for."""
    room = work.settings.max_in_flight_jobs - in_flight_jobs
    if room <= 0 or batch.submitted >= batch.total:
        return
    end = min(batch.submitted + work.settings.submit_chunk, batch.total)
    raws = cast(
        "list[bytes]",
        await work.store.redis.lrange(work.store.keys.input(batch.id), batch.submitted, end - 1),
    )
    lines = _within_room(
        [read_submission(batch, batch.submitted + i, raw) for i, raw in enumerate(raws)], room
    )
    outcomes = await asyncio.gather(*(submit_line(work, batch, line) for line in lines))
    await _record(work, batch, lines, outcomes)


def _within_room(lines: list[Submission], room: int) -> list[Submission]:
    """The first lines whose jobs fit in ``room`` (always the first line)."""
    taken: list[Submission] = []
    for line in lines:
        jobs = line.parsed.n if line.parsed is not None else 0
        if taken and jobs > room:
            break
        room -= jobs
        taken.append(line)
    return taken


async def submit_line(
    work: BatchWork, batch: Batch, line: Submission, choices: list[int] | None = None
) -> OpenAIError | _Full | None:
    """Submits the line's jobs (or only ``choices``); None once submitted, the refusal of
    a line that cannot run, or QUEUE_FULL."""
    if line.parsed is None:
        return line.refusal
    try:
        producer = work.pool.producer(line.parsed.model)
    except ValueError as exc:
        return OpenAIError(400, f"model: {exc}", param="model")
    every = line.parsed.job_fields()
    wanted = range(len(every)) if choices is None else choices
    submits = await asyncio.gather(
        *(
            producer.submit(
                **{
                    **every[choice],
                    "id": job_id(batch.id, line.number, choice),
                    "priority": BATCH_LANE,
                    # Not worth running once the batch has expired: the worker ends it.
                    "deadline": float(batch.expires_at),
                }
            )
            for choice in wanted
        ),
        return_exceptions=True,
    )
    for submitted in submits:
        if isinstance(submitted, JobHandle):
            await forget(submitted)
    return _outcome([s for s in submits if not isinstance(s, JobHandle)])


def _outcome(errors: list[BaseException]) -> OpenAIError | _Full | None:
    for error in errors:
        if isinstance(error, QueueFull):
            return _Full.QUEUE_FULL
    for error in errors:
        if isinstance(error, InvalidRequest):
            return OpenAIError(400, str(error), code="invalid_request")
    if errors:
        raise errors[0]
    return None


async def _record(
    work: BatchWork,
    batch: Batch,
    lines: list[Submission],
    outcomes: list[OpenAIError | _Full | None],
) -> None:
    keys = work.store.keys
    pending: dict[FieldT, EncodableT] = {}
    refused: dict[FieldT, EncodableT] = {}
    done = batch.submitted
    for line, outcome in zip(lines, outcomes, strict=True):
        if outcome is _Full.QUEUE_FULL:
            break  # the rest waits for room in the queue; jobs it made are found again
        if isinstance(outcome, OpenAIError):
            refused[str(line.number)] = failed_line(batch.id, line.number, line.custom_id, outcome)
        elif line.parsed is not None:
            pending[str(line.number)] = Pending(line.parsed.model, line.parsed.n).encode()
        done = line.number + 1
    if pending:
        await work.store.redis.hset(keys.pending(batch.id), mapping=pending)
    if refused:
        await work.store.redis.hset(keys.errors(batch.id), mapping=refused)
    if done > batch.submitted:
        await work.store.set_if_status(batch.id, "in_progress", {SUBMITTED: done})

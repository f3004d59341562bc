"""Submitting a batch's lines as jobs on the batch lane, a chunk per step, in file order,
and within a bound of jobs in flight. A line whose body is refused ends at once in the error
file; a full queue stops the chunk there, to be tried again at the next step."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from enum import Enum

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
    input_lines,
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
    """Submits the next lines, a chunk at a time, as many as the in-flight bound leaves
    room for; stops early at a full queue or once the batch stops taking work."""
    room = work.settings.max_in_flight_jobs - in_flight_jobs
    submitted = batch.submitted
    while room > 0 and submitted < batch.total:
        end = min(submitted + work.settings.submit_chunk, batch.total)
        raws = await input_lines(work, batch, list(range(submitted, end)))
        lines = _within_room(
            [read_submission(batch, n, raws[n]) for n in range(submitted, end)], room
        )
        outcomes = await asyncio.gather(*(submit_line(work, batch, line) for line in lines))
        progress = await _record(work, batch, submitted, lines, outcomes)
        if progress is None:
            return
        submitted, jobs = progress
        room -= jobs


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
            await submitted.detach()
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
    start: int,
    lines: list[Submission],
    outcomes: list[OpenAIError | _Full | None],
) -> tuple[int, int] | None:
    """Records the chunk's lines; returns how far the batch is submitted and the jobs
    added, or None where it must wait (a full queue, or the batch stopped taking work)."""
    keys = work.store.keys
    pending: dict[FieldT, EncodableT] = {}
    refused: dict[FieldT, EncodableT] = {}
    done, jobs = start, 0
    for line, outcome in zip(lines, outcomes, strict=True):
        if outcome is _Full.QUEUE_FULL:
            break  # the rest waits for room in the queue; jobs it made are found again
        if isinstance(outcome, OpenAIError):
            refused[str(line.number)] = failed_line(batch.id, line.number, line.custom_id, outcome)
        elif line.parsed is not None:
            pending[str(line.number)] = Pending(line.parsed.model, line.parsed.n).encode()
            jobs += line.parsed.n
        done = line.number + 1
    if pending:
        await work.store.redis.hset(keys.pending(batch.id), mapping=pending)
    if refused:
        await work.store.redis.hset(keys.errors(batch.id), mapping=refused)
    if done == start:
        return None
    if not await work.store.set_if_status(batch.id, "in_progress", {SUBMITTED: done}):
        return None
    return done, jobs

"""A batch's first step: read its input file, check every line, keep the lines with the
batch (so deleting the file later changes nothing), then start it, or fail it with the
lines at fault in ``errors.data``, as OpenAI does."""

from __future__ import annotations

from typing import Any

from redis.typing import EncodableT, FieldT

from exlq.producer.gateways.openai_api.batch_lines import (
    MAX_REPORTED_ERRORS,
    InputCheck,
    batch_error,
)
from exlq.producer.gateways.openai_api.batch_settings import FILE_CHUNK_BYTES
from exlq.producer.gateways.openai_api.batch_store import SUBMITTED
from exlq.producer.gateways.openai_api.batch_work import Batch, BatchWork


class _InputCopy:
    """The checked lines, written to the batch's input list in pieces as they come."""

    def __init__(self, work: BatchWork, batch: Batch) -> None:
        self._work = work
        self._key = work.store.keys.input(batch.id)
        self._held: dict[FieldT, EncodableT] = {}
        self._held_bytes = 0
        self.count = 0

    async def add(self, raw: bytes) -> None:
        self._held[self.count] = raw
        self._held_bytes += len(raw)
        self.count += 1
        if self._held_bytes >= FILE_CHUNK_BYTES:
            await self.flush()

    async def flush(self) -> None:
        if self._held:
            await self._work.store.redis.hset(self._key, mapping=self._held)
        self._held.clear()
        self._held_bytes = 0


async def validate(work: BatchWork, batch: Batch) -> None:
    # A replica that died mid-copy left part of the list: start it over.
    await work.store.redis.delete(work.store.keys.input(batch.id))
    if await work.files.get(batch.input_file_id) is None:
        await fail(
            work,
            batch,
            [
                batch_error(
                    "input_file_not_found", f"input file {batch.input_file_id} no longer exists"
                )
            ],
        )
        return
    copy = _InputCopy(work, batch)
    errors = await _check_lines(work, batch, copy)
    if errors:
        await fail(work, batch, errors)
        return
    await copy.flush()
    now = work.now()
    counts = {"total": copy.count, "completed": 0, "failed": 0}
    fields = {
        "status": "in_progress",
        "in_progress_at": now,
        "request_counts": counts,
        SUBMITTED: 0,
    }
    await work.store.set_if_status(batch.id, "validating", fields)


async def _check_lines(work: BatchWork, batch: Batch, copy: _InputCopy) -> list[dict[str, Any]]:
    settings = work.settings
    check = InputCheck(batch.endpoint, settings.max_line_bytes)
    errors: list[dict[str, Any]] = []
    number = requests = 0
    async for raw in work.files.lines(batch.input_file_id):
        number += 1
        if not raw.strip():
            continue
        requests += 1
        if requests > settings.max_requests:
            errors.append(_too_many(settings.max_requests, number))
            break
        problem = check.problem(number, raw)
        if problem is not None:
            errors.append(problem)
            if len(errors) >= MAX_REPORTED_ERRORS:
                break
        elif not errors:  # a file that fails keeps no lines
            await copy.add(raw)
    if copy.count == 0 and not errors:
        errors.append(batch_error("empty_file", "the input file holds no requests"))
    return errors


def _too_many(max_requests: int, line: int) -> dict[str, Any]:
    return batch_error(
        "too_many_requests",
        f"the file holds more than {max_requests} requests, this server's limit per batch "
        "(EXLQ_BATCH_MAX_REQUESTS)",
        line,
    )


async def fail(work: BatchWork, batch: Batch, errors: list[dict[str, Any]]) -> None:
    fields = {
        "status": "failed",
        "failed_at": work.now(),
        "errors": {"object": "list", "data": errors},
    }
    if await work.store.set_if_status(batch.id, "validating", fields):
        await work.store.close(batch.id)

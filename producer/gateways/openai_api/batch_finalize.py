"""A batch's last steps: stopping its jobs (cancel, expiry), then writing its output and
error files in input order and its final status and counts. Every step can run again after
a crash: the files' ids are the batch's own, and a rewrite starts them over."""

from __future__ import annotations

import asyncio
from typing import cast

from exlq.producer.gateways.openai_api.batch_collect import collect
from exlq.producer.gateways.openai_api.batch_lines import (
    failed_line,
    job_id,
    read_line,
    stopped_line,
)
from exlq.producer.gateways.openai_api.batch_store import ENDING, BatchStatus, Ending
from exlq.producer.gateways.openai_api.batch_work import Batch, BatchWork, pending_lines
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.file_store import FileWriter

# The status a batch holds while it ends each way.
_ENDING_FROM: dict[Ending, BatchStatus] = {
    "completed": "finalizing",
    "cancelled": "cancelling",
    "expired": "in_progress",
}
_STOPPED_CODE: dict[Ending, str] = {
    "cancelled": "batch_cancelled",
    "expired": "batch_expired",
}


async def stop_jobs(work: BatchWork, batch: Batch, ending: Ending) -> None:
    """Cancels every job still in flight, then marks how the batch ends."""
    pending = await pending_lines(work, batch)
    jobs = [
        (entry.model, job_id(batch.id, line, choice))
        for line, entry in pending.items()
        for choice in range(entry.jobs)
    ]
    chunk = work.settings.read_chunk
    for start in range(0, len(jobs), chunk):
        await asyncio.gather(
            *(work.pool.producer(model).cancel(job) for model, job in jobs[start : start + chunk])
        )
    await work.store.set_if_status(batch.id, _ENDING_FROM[ending], {ENDING: ending})


class _Files:
    """The output and error files being written, and their counts."""

    def __init__(self, work: BatchWork, batch: Batch, ending: Ending) -> None:
        name = batch.id.removeprefix("batch_")
        self.output = work.files.writer(f"file-{name}-output")
        self.errors = work.files.writer(f"file-{name}-errors")
        self._batch = batch
        self._ending = ending
        self.completed = 0
        self.failed = 0

    async def add(self, line: int, raw: bytes, found: list[bytes | None]) -> None:
        """One line, from what the output, errors and stopped hashes hold for it."""
        output, error, stopped = found
        if output is not None:
            self.completed += 1
            await self.output.write(output + b"\n")
        elif error is not None:
            self.failed += 1
            await self.errors.write(error + b"\n")
        else:
            await self.errors.write((stopped or self._unfinished(line, raw)) + b"\n")

    def _unfinished(self, line: int, raw: bytes) -> bytes:
        custom_id, _ = read_line(raw)
        code = _STOPPED_CODE.get(self._ending)
        if code is not None:
            return stopped_line(self._batch.id, line, custom_id, code).encode()
        # A completed batch has every line recorded; were one not, say so, not nothing.
        self.failed += 1
        lost = OpenAIError(500, "the request's result was lost", code="internal_error")
        return failed_line(self._batch.id, line, custom_id, lost).encode()


async def finalize(work: BatchWork, batch: Batch) -> None:
    ending = batch.ending
    assert ending is not None
    await collect(work, batch, resubmit_lost=False)
    files = _Files(work, batch, ending)
    keys = work.store.keys
    chunk = work.settings.read_chunk
    for start in range(0, batch.total, chunk):
        lines = [str(line) for line in range(start, min(start + chunk, batch.total))]
        pipe = work.store.redis.pipeline(transaction=False)
        for key in (
            keys.input(batch.id),
            keys.output(batch.id),
            keys.errors(batch.id),
            keys.stopped(batch.id),
        ):
            pipe.hmget(key, lines)
        raws, *found = cast("list[list[bytes | None]]", await pipe.execute())
        for offset, raw in enumerate(raws):
            assert raw is not None
            await files.add(start + offset, raw, [column[offset] for column in found])
    fields = {
        "status": ending,
        f"{ending}_at": work.now(),
        "output_file_id": await _finish(files.output, batch, "output"),
        "error_file_id": await _finish(files.errors, batch, "error"),
        "request_counts": {
            "total": batch.total,
            "completed": files.completed,
            "failed": files.failed,
        },
    }
    if await work.store.set_if_status(batch.id, _ENDING_FROM[ending], fields, unless_ending=False):
        await work.store.close(batch.id)


async def _finish(writer: FileWriter, batch: Batch, kind: str) -> str | None:
    if writer.size == 0:
        return None
    found = await writer.finish(f"{batch.id}_{kind}.jsonl", "batch_output")
    return str(found["id"])

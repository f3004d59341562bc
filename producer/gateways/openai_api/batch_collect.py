"""Collecting a batch's finished lines from the stored results (MGET in chunks, never a
subscription per job), writing each as an output or error line, and submitting again the
jobs Redis lost (neither their state nor their result exists)."""

from __future__ import annotations

import logging
from collections import defaultdict

from pydantic import ValidationError
from redis.typing import EncodableT, FieldT

from exlq.producer.client import AsyncProducer
from exlq.producer.gateways.openai_api.batch_lines import (
    failed_line,
    job_id,
    output_line,
    parse_line_body,
    read_line,
    stopped_line,
)
from exlq.producer.gateways.openai_api.batch_submit import read_submission, submit_line
from exlq.producer.gateways.openai_api.batch_work import (
    Batch,
    BatchWork,
    Pending,
    input_lines,
    pending_lines,
)
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.translate import response_from_results
from exlq.protocol.models import JobResult

log = logging.getLogger(__name__)

JobKey = tuple[int, int]  # (line, choice)


async def collect(work: BatchWork, batch: Batch, *, resubmit_lost: bool) -> int:
    """Records every pending line whose jobs have all ended; returns the jobs still in
    flight. A job the batch's own cancel or expiry stopped ends its line as that batch's
    ending says (batch.ending)."""
    pending = await pending_lines(work, batch)
    if not pending:
        return 0
    results = await _results(work, batch, pending)
    finished: dict[int, list[JobResult]] = {}
    for line, entry in pending.items():
        ended = [results.get((line, choice)) for choice in range(entry.jobs)]
        if all(result is not None for result in ended):
            finished[line] = [result for result in ended if result is not None]
    if finished:
        await _record_finished(work, batch, finished)
    if resubmit_lost:
        await _resubmit_lost(work, batch, pending, results)
    return sum(entry.jobs for line, entry in pending.items() if line not in finished)


async def _results(
    work: BatchWork, batch: Batch, pending: dict[int, Pending]
) -> dict[JobKey, JobResult | None]:
    """Each pending job's stored result, read queue by queue through its producer (one MGET
    per partition of the queue: a partition's keys share a hash slot of a Redis Cluster)."""
    by_model: dict[str, list[JobKey]] = defaultdict(list)
    for line, entry in pending.items():
        by_model[entry.model] += [(line, choice) for choice in range(entry.jobs)]
    results: dict[JobKey, JobResult | None] = {}
    chunk = work.settings.read_chunk
    for model, jobs in by_model.items():
        producer = work.pool.producer(model)
        for start in range(0, len(jobs), chunk):
            part = jobs[start : start + chunk]
            try:
                stored = await producer.get_results([job_id(batch.id, *j) for j in part])
            except ValidationError:
                log.warning("a stored result is not a JobResult; read one by one")
                stored = [await _result(producer, job_id(batch.id, *j)) for j in part]
            results.update(zip(part, stored, strict=True))
    return results


async def _result(producer: AsyncProducer, job: str) -> JobResult | None:
    try:
        return (await producer.get_results([job]))[0]
    except ValidationError:
        log.warning("a stored result is not a JobResult; the job counts as unfinished")
        return None


async def _record_finished(
    work: BatchWork, batch: Batch, finished: dict[int, list[JobResult]]
) -> None:
    keys = work.store.keys
    raws = await input_lines(work, batch, sorted(finished))
    written: dict[str, dict[FieldT, EncodableT]] = {"output": {}, "errors": {}, "stopped": {}}
    for line, raw in raws.items():
        kind, text = _finished_line(work, batch, line, raw, finished[line])
        written[kind][str(line)] = text
    pipe = work.store.redis.pipeline(transaction=True)
    for kind, key in (
        ("output", keys.output(batch.id)),
        ("errors", keys.errors(batch.id)),
        ("stopped", keys.stopped(batch.id)),
    ):
        if written[kind]:
            pipe.hset(key, mapping=written[kind])
    pipe.hdel(keys.pending(batch.id), *(str(line) for line in finished))
    await pipe.execute()


def _finished_line(
    work: BatchWork, batch: Batch, line: int, raw: bytes, results: list[JobResult]
) -> tuple[str, str]:
    """Which file the line goes to, and its text there."""
    custom_id, body = read_line(raw)
    states = {result.state for result in results}
    if states & {"cancelled", "expired"}:
        expired = batch.ending == "expired" or (batch.ending is None and "expired" in states)
        code = "batch_expired" if expired else "batch_cancelled"
        return "stopped", stopped_line(batch.id, line, custom_id, code)
    try:
        parsed = parse_line_body(batch.endpoint, body)
        prefix = "chatcmpl" if parsed.is_chat else "cmpl"
        response = response_from_results(
            parsed, results, f"{prefix}-{job_id(batch.id, line, 0)}", work.now()
        )
    except OpenAIError as exc:
        return "errors", failed_line(batch.id, line, custom_id, exc)
    return "output", output_line(batch.id, line, custom_id, response)


async def _resubmit_lost(
    work: BatchWork,
    batch: Batch,
    pending: dict[int, Pending],
    results: dict[JobKey, JobResult | None],
) -> None:
    missing = [job for job, result in results.items() if result is None]
    if not missing:
        return
    by_model: dict[str, list[JobKey]] = defaultdict(list)
    for line, choice in missing:
        by_model[pending[line].model].append((line, choice))
    lost: dict[int, list[int]] = defaultdict(list)
    for model, jobs in by_model.items():
        ids = [job_id(batch.id, line, choice) for line, choice in jobs]
        held = await work.pool.producer(model).states_held(ids)
        for (line, choice), exists in zip(jobs, held, strict=True):
            if not exists:
                lost[line].append(choice)
    if not lost:
        return
    log.warning("batch %s: Redis lost %d jobs; submitting them again", batch.id, len(lost))
    raws = await input_lines(work, batch, sorted(lost))
    for line, raw in raws.items():
        await submit_line(work, batch, read_submission(batch, line, raw), lost[line])

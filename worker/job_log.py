"""A job's lines in the worker's log: one INFO line when it ends, with what an operator looks
for first (how it ended, its tokens, where its time went), and at DEBUG one when it is taken
from the stream and one when it starts. A text line is logfmt (``key=value``), which log
tools parse; in JSON mode (exlq.logs) the same fields are keys of the line's object, through
the record's ``extra``."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping

from exlq.worker.engines.base import JobEnded, JobErrored
from exlq.worker.running_job import RunningJob

log = logging.getLogger(__name__)

FieldValue = str | int | float | None


class Logfmt:
    """Fields as ``key=value`` pairs, built only if a handler formats the record."""

    __slots__ = ("fields",)

    def __init__(self, fields: Mapping[str, FieldValue]) -> None:
        self.fields = fields

    def __str__(self) -> str:
        return " ".join(f"{key}={_logfmt_value(value)}" for key, value in self.fields.items())


def _logfmt_value(value: FieldValue) -> str:
    if value is None:
        return '""'
    if isinstance(value, float):
        return f"{value:.6g}"
    text = str(value)
    if text and text.isprintable() and not any(c in text for c in ' ="\\'):
        return text
    return json.dumps(text)  # quoted, with escapes: what logfmt readers take


def end_fields(
    job: RunningJob, queue: str, ended: JobEnded | JobErrored, now: float
) -> dict[str, FieldValue]:
    """What the end line says of ``job``: how it ended (its finish reason, or its error
    code), its tokens (``prompt_tokens`` None where the engine reported none: an error), and
    its times in seconds (``ttft_s`` None for a job that made no token)."""
    timings = job.timings(now)
    outcome: dict[str, FieldValue]
    if isinstance(ended, JobEnded):
        outcome = {"finish_reason": job.stop_reason or ended.finish_reason}
        prompt_tokens: int | None = ended.prompt_tokens
        generated_tokens = ended.completion_tokens
    else:
        outcome = {"error": ended.code}
        prompt_tokens, generated_tokens = None, job.completion_tokens
    first_token_s = timings.first_token_s
    return {
        "job_id": job.job_id,
        "queue": queue,
        "lane": job.lane,
        "attempt": job.attempt,
        **outcome,
        "prompt_tokens": prompt_tokens,
        "generated_tokens": generated_tokens,
        "queue_wait_s": round(timings.queued_s, 6),
        "ttft_s": None if first_token_s is None else round(first_token_s, 6),
        "duration_s": round(timings.total_s, 6),
    }


def job_ended(job: RunningJob, queue: str, ended: JobEnded | JobErrored, now: float) -> None:
    """The job's end line, at INFO."""
    if log.isEnabledFor(logging.INFO):
        fields = end_fields(job, queue, ended, now)
        log.info("job ended %s", Logfmt(fields), extra=fields)


def job_taken(job: RunningJob, queue: str) -> None:
    """At DEBUG: the worker took the job's entry from its stream."""
    if log.isEnabledFor(logging.DEBUG):
        fields = {"job_id": job.job_id, "queue": queue, "lane": job.lane, "entry": job.entry_id}
        log.debug("job taken %s", Logfmt(fields), extra=fields)


def job_started(job: RunningJob, queue: str) -> None:
    """At DEBUG: the start script let the job run; its attempt is counted."""
    if log.isEnabledFor(logging.DEBUG):
        fields: dict[str, FieldValue] = {
            "job_id": job.job_id,
            "queue": queue,
            "lane": job.lane,
            "attempt": job.attempt,
            "queue_wait_s": round(job.timings(job.started_at).queued_s, 6),
        }
        log.debug("job started %s", Logfmt(fields), extra=fields)

"""Exceptions the producer SDK raises; each message says what happened and what to do."""

from __future__ import annotations

from exlq.protocol.models import ErrorInfo, InvalidRequest


class ExlqError(Exception):
    """Base of every error the SDK raises on purpose."""


class QueueFull(ExlqError):
    """The queue's backlog is at its limit; retry later or add workers."""


class NoWorkers(ExlqError):
    """No live worker serves the queue, and the job had not started: it was cancelled, so
    that it does not run later, unawaited."""

    def __init__(self, job_id: str, queue: str, stale_after_s: float) -> None:
        super().__init__(
            f"job {job_id} was not started and is cancelled: no live worker serves queue "
            f"{queue!r} (none has sent a heartbeat in the last {stale_after_s:g}s). Start one "
            f"(exlq worker --queue {queue}), or let jobs wait for workers that start later "
            "(one still loading its model, a fleet scaled to zero): wait_for_worker=True, "
            "exlq submit --wait-for-worker"
        )
        self.job_id = job_id
        self.queue = queue


class JobFailed(ExlqError):
    """The job ended with an error (bad input, engine failure, too many attempts)."""

    def __init__(self, job_id: str, error: ErrorInfo) -> None:
        super().__init__(f"job {job_id} failed ({error.code}): {error.message}")
        self.job_id = job_id
        self.error = error


class JobLost(ExlqError):
    """Redis holds neither the job's state nor its result, so nothing will end the wait:
    Redis restarted without persistence or was flushed, or the state expired (a job that
    waited queued longer than the producer's ``state_ttl_s``)."""

    def __init__(self, job_id: str) -> None:
        super().__init__(
            f"job {job_id} is lost: Redis no longer holds its state or its result (Redis "
            "restarted without persistence, was flushed, or the job's state expired); "
            "submit it again"
        )
        self.job_id = job_id


class NotReplicated(ExlqError):
    """A submit asked for ``replicas`` copies (AsyncProducer(replicas=N)) and fewer replicas
    confirmed the job within the wait: it is queued on the master, and a failover now could
    lose it. Submitting the same id again is safe: it is one job."""

    def __init__(self, job_id: str, confirmed: int, wanted: int, wait_ms: int) -> None:
        super().__init__(
            f"job {job_id} is queued, but {confirmed} of the {wanted} replicas asked for "
            f"confirmed it within {wait_ms} ms (Redis WAIT): a failover now could lose it. "
            "Submit it again under the same id (it stays one job) to wait again, or check "
            "the replicas (INFO replication)"
        )
        self.job_id = job_id
        self.confirmed = confirmed


class JobRestarted(ExlqError):
    """A retry produced text that differs from what stream_text() had already yielded."""


__all__ = [
    "ExlqError",
    "InvalidRequest",
    "JobFailed",
    "JobLost",
    "JobRestarted",
    "NoWorkers",
    "NotReplicated",
    "QueueFull",
]

"""Exceptions the producer SDK raises; each message says what happened and what to do."""

from __future__ import annotations

from exlq.protocol.models import ErrorInfo, InvalidRequest


class ExlqError(Exception):
    """Base of every error the SDK raises on purpose."""


class QueueFull(ExlqError):
    """The queue's backlog is at its limit; retry later or add workers."""


class JobFailed(ExlqError):
    """The job ended with an error (bad input, engine failure, too many attempts)."""

    def __init__(self, job_id: str, error: ErrorInfo) -> None:
        super().__init__(f"job {job_id} failed ({error.code}): {error.message}")
        self.job_id = job_id
        self.error = error


class JobRestarted(ExlqError):
    """A retry produced text that differs from what stream_text() had already yielded."""


__all__ = ["ExlqError", "InvalidRequest", "JobFailed", "JobRestarted", "QueueFull"]

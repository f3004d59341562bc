"""How a job's failure reads to an OpenAI client: the worker's error codes and the SDK's
exceptions, each as an OpenAIError with the status OpenAI's clients map to the right type."""

from __future__ import annotations

from exlq.producer.errors import (
    ExlqError,
    InvalidRequest,
    JobFailed,
    JobLost,
    JobRestarted,
    NoWorkers,
    QueueFull,
)
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.protocol.models import ErrorInfo

# The worker's ErrorEvent codes (exlq.protocol.models.ErrorInfo) -> HTTP status. A job the
# worker refuses as written is the client's fault (400); the rest are the server's (500).
_STATUS_OF_CODE = {"invalid_request": 400}


def error_from_info(error: ErrorInfo) -> OpenAIError:
    status = _STATUS_OF_CODE.get(error.code, 500)
    return OpenAIError(status, error.message, code=error.code)


def no_worker_error(model: str) -> OpenAIError:
    return OpenAIError(
        503,
        f"No live worker serves model {model!r} now: retry later.",
        code="no_live_worker",
    )


def error_from_sdk(exc: ExlqError | InvalidRequest, model: str) -> OpenAIError:
    """The OpenAIError for an exception the SDK raised while submitting or waiting."""
    if isinstance(exc, InvalidRequest):
        return OpenAIError(400, str(exc), code="invalid_request")
    if isinstance(exc, QueueFull):
        return OpenAIError(429, str(exc), code="queue_full")
    if isinstance(exc, NoWorkers):
        return no_worker_error(model)
    if isinstance(exc, JobFailed):
        return error_from_info(exc.error)
    if isinstance(exc, JobLost | JobRestarted):
        return OpenAIError(500, str(exc), code="job_lost")
    return OpenAIError(500, str(exc), code="internal_error")

"""One `infer`: an exlq job on the queue, its token events as exllamav2's chunks, its done
event as exllamav2's full message."""

from __future__ import annotations

import logging

from redis.exceptions import RedisError

from exlq.producer.client import AsyncProducer
from exlq.producer.errors import JobFailed, JobLost, JobRestarted, NoWorkers, QueueFull
from exlq.producer.gateways.exllamav2_ws import protocol
from exlq.producer.gateways.exllamav2_ws.protocol import (
    Message,
    chunk_message,
    error_message,
    full_message,
)
from exlq.producer.gateways.exllamav2_ws.request_models import InferRequest, UnsupportedSetting
from exlq.producer.gateways.exllamav2_ws.session import RunningInfer, Session
from exlq.protocol.models import InvalidRequest

log = logging.getLogger(__name__)

# Errors whose message is the answer as it stands, by the code the client gets.
_PLAIN_ERRORS: tuple[tuple[type[Exception], str], ...] = (
    (UnsupportedSetting, protocol.UNSUPPORTED),
    (InvalidRequest, protocol.INVALID_REQUEST),
    (QueueFull, protocol.QUEUE_FULL),
    (NoWorkers, protocol.NO_WORKERS),
    (JobLost, protocol.JOB_LOST),
    (JobRestarted, protocol.JOB_RESTARTED),
)


async def run_infer(
    session: Session,
    running: RunningInfer,
    producer: AsyncProducer,
    head: Message,
    request: InferRequest,
    eos_ids: frozenset[int],
) -> None:
    """Answer one infer: its chunks, then its full message or an error message."""
    try:
        reply = await _generate(session, running, producer, head, request, eos_ids)
    except Exception as exc:  # every failure answers this request; the connection goes on
        reply = _error_reply(head, exc)
    finally:
        session.finish_infer(running)
    await session.send(reply)


async def _generate(
    session: Session,
    running: RunningInfer,
    producer: AsyncProducer,
    head: Message,
    request: InferRequest,
    eos_ids: frozenset[int],
) -> Message:
    handle = await producer.submit(**request.submit_fields(eos_ids))
    await running.attach(handle)
    response = ""
    async for piece in handle.stream_text():
        if not piece:  # exllamav2 sends no empty chunk
            continue
        response += piece
        if request.stream:
            so_far = response if request.stream_full else None
            await session.send(chunk_message(head, request.util_text, piece, so_far))
    result = await handle.result()
    # A job that did not fail has a finish reason; "stop" stands in should one be missing.
    return full_message(head, request.util_text, result.text, result.finish_reason or "stop")


def _error_reply(head: Message, exc: Exception) -> Message:
    if isinstance(exc, JobFailed):
        return error_message(head, exc.error.code, exc.error.message)
    for kind, code in _PLAIN_ERRORS:
        if isinstance(exc, kind):
            return error_message(head, code, str(exc))
    if isinstance(exc, RedisError | OSError):
        return error_message(head, protocol.REDIS_UNAVAILABLE, f"Redis: {exc}")
    log.exception("infer failed")
    return error_message(head, protocol.INTERNAL_ERROR, f"the gateway failed: {exc!r}")

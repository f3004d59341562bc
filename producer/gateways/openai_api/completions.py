"""POST /v1/completions and /v1/chat/completions: check the model is served, submit the n
jobs, answer whole or as a stream; a client that goes away cancels its jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import time
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.jobs import JobRunner, JobSet
from exlq.producer.gateways.openai_api.model_check import ModelCheck
from exlq.producer.gateways.openai_api.streaming import ChunkWriter, stream_chunks
from exlq.producer.gateways.openai_api.translate import CHAT, COMPLETIONS, parse_body
from exlq.producer.gateways.openai_api.whole import whole_response

router = APIRouter()
# Status for a request whose client left before its answer (nginx's convention); nobody
# reads it, but the access log shows the request was given up.
CLIENT_CLOSED = 499


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    return await _serve(request, COMPLETIONS, "cmpl")


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    return await _serve(request, CHAT, "chatcmpl")


async def _serve(request: Request, endpoint: str, id_prefix: str) -> Response:
    parsed = parse_body(endpoint, await _json_body(request))
    checks: ModelCheck = request.app.state.model_check
    runner: JobRunner = request.app.state.jobs
    await checks.require_live(parsed.model)
    response_id = f"{id_prefix}-{secrets.token_hex(12)}"
    created = int(time.time())
    jobs = await runner.submit(parsed, response_id)
    if parsed.stream:
        writer = ChunkWriter(parsed, response_id, created)
        # sse-starlette cancels the generator when the client disconnects; its finally
        # cancels the jobs. On SIGTERM it lets the stream run to its end for the grace
        # period, so a rolling restart cuts no answer short.
        grace = request.app.state.settings.grace_seconds
        return EventSourceResponse(
            stream_chunks(writer, jobs), sep="\n", shutdown_grace_period=grace
        )
    try:
        body = await _unless_disconnected(
            request, whole_response(parsed, jobs, response_id, created)
        )
    finally:
        jobs.abandon()  # ended jobs are left alone; a disconnect cancels the rest
    if body is None:
        return Response(status_code=CLIENT_CLOSED)
    return JSONResponse(body)


async def _json_body(request: Request) -> dict[str, Any]:
    try:
        body = await request.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise OpenAIError(400, "The request body is not valid JSON.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise OpenAIError(400, "The request body must be a JSON object.", code="invalid_json")
    return body


async def _unless_disconnected(request: Request, work: Any) -> dict[str, Any] | None:
    """The answer, or None if the client disconnected first. The wait for a disconnect
    reads the ASGI channel (the body has been read, so the next message the server sends
    is http.disconnect): no polling of request.is_disconnected()."""
    answer: asyncio.Task[dict[str, Any]] = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (answer, gone):
            if not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
    if answer.cancelled():
        return None
    return answer.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


__all__ = ["JobSet", "router"]

"""/v1/batches: create a batch from an uploaded file of requests, retrieve, list and cancel
it. The work itself is the batch runner's (batch_runner.py), in whichever replica holds
the batch's lease."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict, Field

from exlq.producer.gateways.openai_api.batch_settings import batch_settings_of
from exlq.producer.gateways.openai_api.batch_store import BatchStore, batch_object, new_batch_id
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.files import file_store
from exlq.producer.gateways.openai_api.list_page import ListPage
from exlq.producer.gateways.openai_api.translate import ENDPOINTS

router = APIRouter()

_MetadataKey = Annotated[str, Field(max_length=64)]
_MetadataValue = Annotated[str, Field(max_length=512)]


class BatchBody(BaseModel):
    """POST /v1/batches, as OpenAI documents it; what this server cannot honour is refused
    with a 400 that names it."""

    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: Annotated[dict[_MetadataKey, _MetadataValue], Field(max_length=16)] | None = None


def batch_store(request: Request) -> BatchStore:
    pool = request.app.state.pool
    return BatchStore(pool.batch_redis, pool.batch_prefix)


def _not_found(batch_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such Batch object: {batch_id}", param="batch_id")


@router.post("/v1/batches")
async def create_batch(request: Request, body: BatchBody) -> dict[str, Any]:
    if body.endpoint not in ENDPOINTS:
        raise OpenAIError(
            400,
            f"endpoint: {body.endpoint!r} is not supported by this server; use "
            f"{' or '.join(ENDPOINTS)}",
            param="endpoint",
        )
    if body.completion_window != "24h":
        raise OpenAIError(
            400, "completion_window: only '24h' is supported", param="completion_window"
        )
    found = await file_store(request).get(body.input_file_id)
    if found is None:
        raise OpenAIError(404, f"No such File object: {body.input_file_id}", param="input_file_id")
    if found["purpose"] != "batch":
        raise OpenAIError(
            400,
            f"input_file_id: file {body.input_file_id} has purpose {found['purpose']!r}; "
            "a batch reads a file uploaded with purpose 'batch'",
            param="input_file_id",
        )
    now = time.time()
    window_s = batch_settings_of(request.app.state).completion_window_s
    fields = _new_batch(body, int(now), int(now + window_s))
    await batch_store(request).create(fields, now)
    return batch_object(fields)


def _new_batch(body: BatchBody, created_at: int, expires_at: int) -> dict[str, Any]:
    return {
        "id": new_batch_id(),
        "object": "batch",
        "endpoint": body.endpoint,
        "errors": None,
        "input_file_id": body.input_file_id,
        "completion_window": body.completion_window,
        "status": "validating",
        "created_at": created_at,
        "expires_at": expires_at,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": body.metadata,
    }


@router.get("/v1/batches/{batch_id}")
async def retrieve_batch(request: Request, batch_id: str) -> dict[str, Any]:
    found = await batch_store(request).get(batch_id)
    if found is None:
        raise _not_found(batch_id)
    return found


@router.get("/v1/batches")
async def list_batches(
    request: Request,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> dict[str, Any]:
    page: ListPage = await batch_store(request).page(after, limit)
    return page.body()


_CANCELLABLE: frozenset[str] = frozenset({"validating", "in_progress", "cancelling", "cancelled"})


@router.post("/v1/batches/{batch_id}/cancel")
async def cancel_batch(request: Request, batch_id: str) -> dict[str, Any]:
    store = batch_store(request)
    if await store.get(batch_id) is None:
        raise _not_found(batch_id)
    had: str = await store.request_cancel(batch_id, int(time.time()))
    if had not in _CANCELLABLE:
        raise OpenAIError(
            409, f"Cannot cancel a batch with status {had!r}.", code="batch_not_cancellable"
        )
    found = await store.get(batch_id)
    if found is None:
        raise _not_found(batch_id)
    if had == "in_progress" and found["status"] == "in_progress":
        # It was already ending (its window closed): let it end as it is.
        raise OpenAIError(
            409, "Cannot cancel a batch that is expiring.", code="batch_not_cancellable"
        )
    return found

"""GET /v1/models and /v1/models/{model}: the queues live workers serve, from their
heartbeats, in OpenAI's list shape."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.producers import LiveModel, ProducerPool

router = APIRouter()
OWNER = "exlq"


def _model_body(model: LiveModel) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": model.created, "owned_by": OWNER}


@router.get("/v1/models")
async def list_models(request: Request) -> dict[str, Any]:
    pool: ProducerPool = request.app.state.pool
    return {"object": "list", "data": [_model_body(m) for m in await pool.live_models()]}


@router.get("/v1/models/{model:path}")
async def get_model(model: str, request: Request) -> dict[str, Any]:
    pool: ProducerPool = request.app.state.pool
    # One queue's heartbeats, not a scan: a model id may name any queue.
    live = await pool.live_model(model)
    if live is not None:
        return _model_body(live)
    raise OpenAIError(
        404,
        f"The model {model!r} does not exist or no live worker serves it.",
        code="model_not_found",
        param="model",
    )

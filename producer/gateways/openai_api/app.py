"""The gateway's FastAPI application: the routes, their API-key dependency, the errors in
OpenAI's shape, and the Redis connections that live as long as the app."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from starlette.exceptions import HTTPException

from exlq._version import __version__
from exlq.producer.gateways.openai_api import batches, completions, files, models_routes
from exlq.producer.gateways.openai_api.auth import ApiKeys, load_keys
from exlq.producer.gateways.openai_api.batch_runner import BatchRunner
from exlq.producer.gateways.openai_api.batch_settings import BatchSettings
from exlq.producer.gateways.openai_api.errors import (
    OpenAIError,
    error_body,
    openai_error_response,
    validation_error_response,
)
from exlq.producer.gateways.openai_api.in_flight import InFlightLimit
from exlq.producer.gateways.openai_api.jobs import JobRunner
from exlq.producer.gateways.openai_api.model_check import ModelCheck
from exlq.producer.gateways.openai_api.producers import ProducerPool
from exlq.producer.gateways.openai_api.settings import GatewaySettings

log = logging.getLogger(__name__)
# /readyz waits this long for Redis's PONG before it says not ready.
READY_TIMEOUT_S = 2.0


def create_app(settings: GatewaySettings, batch_settings: BatchSettings | None = None) -> FastAPI:
    """The app. Its lifespan puts the ProducerPool in ``app.state.pool`` and runs this
    replica's BatchRunner; the settings are in ``app.state.settings`` and
    ``app.state.batch_settings`` (EXLQ_BATCH_* when not given); ``app.state.api_keys`` is the
    dependency every /v1 route carries."""
    batch_settings = batch_settings or BatchSettings()

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        pool = ProducerPool(
            settings.redis_url,
            prefix=settings.prefix,
            worker_stale_after_s=settings.worker_stale_after_s,
            max_backlog=settings.max_backlog,
            credentials=settings.redis_credentials,
        )
        app.state.pool = pool
        app.state.model_check = ModelCheck(pool)
        app.state.jobs = JobRunner(pool)
        await pool.place_batch_api()
        try:
            async with BatchRunner(pool, batch_settings):
                yield
        finally:
            await app.state.jobs.close()
            await pool.close()

    app = FastAPI(title="exlq OpenAI gateway", version=__version__, lifespan=lifespan)
    app.state.settings = settings
    app.state.batch_settings = batch_settings
    api_keys = ApiKeys(load_keys(settings.api_keys_file, settings.api_keys))
    app.state.api_keys = api_keys
    for router in (models_routes.router, completions.router):
        app.include_router(router, dependencies=[Depends(api_keys)])
    for router in (files.router, batches.router):
        app.include_router(router, dependencies=[Depends(api_keys)])
    app.add_api_route("/healthz", healthz, methods=["GET"])
    app.add_api_route("/readyz", readyz, methods=["GET"])
    _add_error_handlers(app)
    if settings.max_in_flight:
        app.add_middleware(InFlightLimit, limit=settings.max_in_flight)
    return app


def _add_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(OpenAIError, openai_error_response)
    app.add_exception_handler(RequestValidationError, validation_error_response)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(RedisConnectionError, _redis_away)
    app.add_exception_handler(RedisTimeoutError, _redis_away)


async def healthz() -> dict[str, str]:
    """Liveness: the process answers."""
    return {"status": "ok"}


async def readyz(request: Request) -> JSONResponse:
    """Readiness: Redis answers a PING."""
    pool: ProducerPool = request.app.state.pool
    try:
        async with asyncio.timeout(READY_TIMEOUT_S):
            await pool.redis.ping()
    except (RedisConnectionError, RedisTimeoutError, OSError, TimeoutError) as exc:
        return JSONResponse({"status": "redis unavailable", "error": str(exc)}, status_code=503)
    return JSONResponse({"status": "ok"})


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    """Starlette's own errors (an unknown path, a wrong method) in OpenAI's shape."""
    assert isinstance(exc, HTTPException)
    return JSONResponse(
        error_body(exc.status_code, str(exc.detail)),
        status_code=exc.status_code,
        headers=exc.headers,
    )


async def _redis_away(request: Request, exc: Exception) -> JSONResponse:
    log.warning("%s %s: Redis is unavailable (%s)", request.method, request.url.path, exc)
    body = error_body(
        503, "The queue's Redis is unavailable: retry later.", code="redis_unavailable"
    )
    return JSONResponse(body, status_code=503)

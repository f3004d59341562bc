"""The echo engine: streams the prompt's words back at a set pace; runs the whole system
(Redis, worker, SDK, metrics) without a GPU or a model."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from exlq.worker.engines.base import Engine
from exlq.worker.engines.registry import EngineSpec, LoadRequest


class EchoSettings(BaseSettings):
    """`-o NAME=VALUE` or EXLQ_ECHO_<NAME>."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_ECHO_", extra="forbid", frozen=True)

    tokens_per_second: float = Field(50.0, gt=0, description="words a job gets per second")


def _load(request: LoadRequest) -> Engine:
    from exlq.worker.engines.echo.engine import EchoEngine

    assert isinstance(request.options, EchoSettings)
    return EchoEngine(request.max_batch_size, request.options.tokens_per_second)


ENGINE = EngineSpec(
    name="echo",
    summary="no model: echoes the prompt's words, for trying and testing the system",
    settings=EchoSettings,
    load=_load,
    needs_model=False,
)

"""Engines behind one interface; heavy ones are imported only when chosen."""

from __future__ import annotations

from exlq.worker.engines.base import Engine, EngineUnavailable
from exlq.worker.settings import WorkerSettings


def build_engine(settings: WorkerSettings) -> Engine:
    if settings.engine == "echo":
        from exlq.worker.engines.echo.engine import EchoEngine

        return EchoEngine(settings.max_batch_size, settings.echo_tokens_per_second)
    if settings.engine == "exllamav2":
        from exlq.worker.engines.exllamav2.engine import load_exllamav2_engine

        return load_exllamav2_engine(settings)
    raise EngineUnavailable(f"unknown engine {settings.engine!r}: use exllamav2 or echo")


__all__ = ["Engine", "EngineUnavailable", "build_engine"]

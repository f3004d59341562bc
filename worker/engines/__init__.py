"""Engines behind one contract (base.py), found by name (registry.py); an engine's heavy
libraries are imported only when it is loaded."""

from __future__ import annotations

from exlq.worker.engines.base import Engine, EngineUnavailable
from exlq.worker.engines.registry import LoadRequest, find


def build_engine(engine: str, request: LoadRequest) -> Engine:
    """Load the engine called ``engine``; EngineUnavailable says why it cannot run here."""
    return find(engine).load(request)


__all__ = ["Engine", "EngineUnavailable", "build_engine"]

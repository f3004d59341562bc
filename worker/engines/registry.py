"""Engines by name: the ones exlq ships and any another package registers.

An engine is a package that exposes one ``EngineSpec``: its name, a one-line summary, the
pydantic model of its own settings, and a loader. exlq's engines are listed here; another
package adds one through the ``exlq.engines`` entry-point group::

    [project.entry-points."exlq.engines"]
    myengine = "mypackage.engine:ENGINE"

Looking an engine up imports only its spec module, never torch or the engine's library:
the loader imports those when the engine is built.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import entry_points
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from exlq.worker.engines.base import Engine, EngineUnavailable

ENTRY_POINT_GROUP = "exlq.engines"

# exlq's own engines: name -> the module whose ENGINE is their spec.
BUILTIN = {
    "exllamav2": "exlq.worker.engines.exllamav2",
    "exllamav3": "exlq.worker.engines.exllamav3",
    "transformers": "exlq.worker.engines.transformers",
    "echo": "exlq.worker.engines.echo",
}


@dataclass(frozen=True, slots=True)
class LoadRequest:
    """What every engine is built from: the serving settings it must honour and its own."""

    model: Path | None
    max_batch_size: int
    options: BaseModel  # an instance of the spec's ``settings``


@dataclass(frozen=True, slots=True)
class EngineSpec:
    name: str
    summary: str
    settings: type[BaseModel]
    load: Callable[[LoadRequest], Engine]
    needs_model: bool = True

    def options(self, given: Mapping[str, Any]) -> BaseModel:
        """The engine's settings from ``given`` (flags' NAME=VALUE pairs) over its
        environment variables; an unknown or bad option raises ValueError saying which
        options exist."""
        try:
            return self.settings(**given)
        except ValidationError as exc:
            known = ", ".join(self.settings.model_fields) or "none"
            problems = "; ".join(
                f"{'.'.join(str(p) for p in error['loc'])}: {error['msg']}"
                for error in exc.errors()
            )
            raise ValueError(
                f"engine {self.name!r} options: {problems} (its options: {known})"
            ) from None


def available() -> dict[str, str]:
    """Every engine's name and where its spec lives (module[:attribute])."""
    found = {name: module for name, module in BUILTIN.items()}
    for entry in entry_points(group=ENTRY_POINT_GROUP):
        found.setdefault(entry.name, entry.value)
    return found


def find(name: str) -> EngineSpec:
    """The spec of the engine called ``name``; EngineUnavailable names the known ones."""
    where = available().get(name)
    if where is None:
        known = ", ".join(sorted(available()))
        raise EngineUnavailable(f"unknown engine {name!r}: use one of {known}")
    module_name, _, attribute = where.partition(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise EngineUnavailable(f"engine {name!r} cannot be imported here: {exc}") from exc
    spec = getattr(module, attribute or "ENGINE", None)
    if not isinstance(spec, EngineSpec):
        raise EngineUnavailable(f"{where} does not name an exlq EngineSpec")
    return spec

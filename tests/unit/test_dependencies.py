"""What an install brings: on the versions constraints.txt pins, the hiredis fast paths are
on (on others they may be off, and the SDK still works: tests/integration/test_slow_paths.py;
this fails on an upgrade that turns one off). And pyproject.toml's ranges, constraints.txt's
pins and the floors .ci/lowest.py installs agree."""

from __future__ import annotations

import importlib.util
import tomllib
from types import ModuleType

import redis.asyncio as aioredis
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from redis._parsers import _AsyncHiredisParser

from exlq.producer import buffered_replies
from exlq.protocol import command_packing
from tests.conftest import ROOT


def test_redis_replies_are_parsed_by_hiredis() -> None:
    # A worker's read of 128 entries took 5.2 ms with redis-py's own parser and 1.5 ms
    # with hiredis (docs/PERFORMANCE.md); an install without it is slow, not broken.
    client = aioredis.Redis()
    connection = client.connection_pool.make_connection()
    assert isinstance(connection._parser, _AsyncHiredisParser)


def test_event_connections_take_buffered_replies() -> None:
    assert buffered_replies.PARSER_CLASS is not None, buffered_replies.WHY


def test_commands_are_packed_in_c() -> None:
    assert command_packing.packs_in_c(), command_packing._WHY


# -- pyproject's ranges, constraints.txt's pins and .ci/lowest.py's floors agree ----------


def _lowest_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("ci_lowest", ROOT / ".ci" / "lowest.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _requirements() -> tuple[list[Requirement], list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = [Requirement(text) for text in project["dependencies"]]
    extras = [
        Requirement(text) for texts in project["optional-dependencies"].values() for text in texts
    ]
    return base, extras


def test_base_dependencies_are_ranges_not_pins() -> None:
    base, _ = _requirements()
    for requirement in base:
        assert not any(spec.operator in ("==", "===") for spec in requirement.specifier), (
            requirement
        )


def test_constraints_pin_every_dependency_inside_its_range() -> None:
    pinned = _lowest_script().pins(ROOT / "constraints.txt")
    base, extras = _requirements()
    for requirement in base + extras:
        if requirement.name in ("exlq", "torch"):  # an extra of this package; the image's torch
            continue
        version = pinned.get(canonicalize_name(requirement.name))
        assert version is not None, f"constraints.txt pins no {requirement.name}"
        assert requirement.specifier.contains(version, prereleases=True), (requirement, version)


def test_the_lowest_run_installs_each_base_dependency_at_the_floor_of_its_range() -> None:
    floors = _lowest_script().floors(ROOT / "pyproject.toml")
    base, _ = _requirements()
    assert set(floors) == {canonicalize_name(r.name) for r in base}
    for requirement in base:
        floor = floors[canonicalize_name(requirement.name)]
        assert requirement.specifier.contains(floor), (requirement, floor)

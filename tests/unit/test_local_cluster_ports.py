"""The test cluster's nodes each get a port of their own, even when the system hands the
same free port out twice before any node has bound it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from bench.local_cluster import distinct_free_ports


def _handing_out(ports: list[int]) -> Iterator[int]:
    yield from ports


def test_a_port_handed_out_twice_is_taken_once() -> None:
    handed = _handing_out([41779, 41779, 41780, 41779, 41781])
    assert distinct_free_ports(3, take=lambda: next(handed)) == [41779, 41780, 41781]


def test_too_few_different_ports_is_an_error_not_a_clash() -> None:
    with pytest.raises(RuntimeError, match="1 different free ports of the 2"):
        distinct_free_ports(2, take=lambda: 41779)


def test_real_free_ports_are_all_different() -> None:
    ports = distinct_free_ports(12)
    assert len(set(ports)) == 12

"""The bench's CPU placement: parsing, refusal, and restoring the caller's CPUs."""

from __future__ import annotations

import os

import pytest

from bench.placement import _parse, _ranges, on_cpus, placement

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only"
)


def test_lists_and_ranges_round_trip() -> None:
    assert _parse("0-3,6,8-9") == {0, 1, 2, 3, 6, 8, 9}
    assert _ranges({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"


def test_all_means_no_placement() -> None:
    assert placement("all").server is None and placement("all").load is None


@needs_affinity
def test_naming_every_cpu_or_an_unknown_one_is_refused() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    with pytest.raises(ValueError, match="some, not all"):
        placement(_ranges(set(allowed)))
    with pytest.raises(ValueError, match="some, not all"):
        placement(str(max(allowed) + 1000))


@needs_affinity
def test_on_cpus_pins_the_thread_and_restores_it() -> None:
    before = os.sched_getaffinity(0)
    one = frozenset({min(before)})
    with on_cpus(one):
        assert os.sched_getaffinity(0) == one
    assert os.sched_getaffinity(0) == before
    with on_cpus(None):
        assert os.sched_getaffinity(0) == before


@needs_affinity
def test_a_named_set_leaves_the_rest_to_the_load() -> None:
    allowed = sorted(os.sched_getaffinity(0))
    if len(allowed) < 2:
        pytest.skip("needs two CPUs")
    place = placement(str(allowed[0]))
    assert place.server == {allowed[0]} and place.load == set(allowed[1:])
    assert "system under test on CPUs" in place.describe()

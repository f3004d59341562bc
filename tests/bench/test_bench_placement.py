"""The bench's CPU placement: parsing, refusal, and restoring the caller's CPUs."""

from __future__ import annotations

import os

import pytest

from bench.placement import (
    Placement,
    _ranges,
    on_cpus,
    parse_cpus,
    placement,
    smt_siblings,
    stepper_cpu,
)

needs_affinity = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity"), reason="CPU affinity is Linux-only"
)


def test_lists_and_ranges_round_trip() -> None:
    assert parse_cpus("0-3,6,8-9") == {0, 1, 2, 3, 6, 8, 9}
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


def _pairs(cpu: int) -> frozenset[int]:
    """16 CPUs on 8 cores, as Linux numbers SMT siblings on many machines: i and i + 8."""
    return frozenset({cpu % 8, cpu % 8 + 8})


def test_auto_takes_distinct_cores_and_leaves_their_siblings_idle() -> None:
    place = placement("auto", _pairs, set(range(16)))
    assert place.server == {0, 1, 2, 3}
    assert place.idle == {8, 9, 10, 11}
    assert place.load == {4, 5, 6, 7, 12, 13, 14, 15}
    assert "SMT siblings 8-11 idle" in place.describe()


def test_auto_skips_the_sibling_of_a_cpu_it_took() -> None:
    # Siblings numbered next to each other: 0-1, 2-3, ...
    place = placement(
        "auto", lambda cpu: frozenset({cpu - cpu % 2, cpu - cpu % 2 + 1}), set(range(16))
    )
    assert place.server == {0, 2, 4, 6}
    assert place.idle == {1, 3, 5, 7}
    assert place.load == set(range(8, 16))


def test_without_smt_auto_is_the_first_four() -> None:
    place = placement("auto", lambda cpu: frozenset({cpu}), set(range(16)))
    assert place.server == {0, 1, 2, 3} and place.load == set(range(4, 16)) and not place.idle


def test_server_and_load_can_both_be_named() -> None:
    place = placement("0-3:4-15", _pairs, set(range(16)))
    assert place.server == {0, 1, 2, 3} and place.load == set(range(4, 16)) and not place.idle
    with pytest.raises(ValueError, match="in both"):
        placement("0-3:3-15", _pairs, set(range(16)))
    with pytest.raises(ValueError, match="auto takes no"):
        placement("auto:4-15", _pairs, set(range(16)))


def test_a_named_server_keeps_its_siblings_from_the_load() -> None:
    place = placement("0-1", _pairs, set(range(16)))
    assert place.idle == {8, 9}
    assert place.load == set(range(16)) - {0, 1, 8, 9}


def test_smt_siblings_include_the_cpu_itself() -> None:
    assert 0 in smt_siblings(0)


def test_the_stepping_threads_cpu_is_one_of_the_systems() -> None:
    place = Placement(frozenset({0, 1, 2, 3}), frozenset(range(4, 16)))
    assert stepper_cpu("auto", place) == 3
    assert stepper_cpu("1", place) == 1
    assert stepper_cpu("none", place) is None
    # Without a placement of two CPUs or more, auto leaves the threads to the scheduler.
    assert stepper_cpu("auto", Placement(None, None)) is None
    assert stepper_cpu("auto", Placement(frozenset({0}), frozenset({1}))) is None
    with pytest.raises(ValueError, match="one of the system's CPUs"):
        stepper_cpu("5", place)
    with pytest.raises(ValueError, match="one of the system's CPUs"):
        stepper_cpu("0", Placement(frozenset({0}), frozenset({1})))
    with pytest.raises(ValueError, match="auto, none or a CPU number"):
        stepper_cpu("last", place)

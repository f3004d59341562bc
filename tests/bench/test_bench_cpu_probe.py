"""bench.cpu_probe: a timed piece of Python work, and a pair's ratio read at equal CPU speed."""

from __future__ import annotations

import os
import statistics

import pytest

from bench.cpu_probe import at_equal_speed, probe_each, probe_ms


def test_the_probe_times_its_work_and_more_work_takes_longer() -> None:
    short = probe_ms(loops=2_000, repeats=3)
    long = probe_ms(loops=200_000, repeats=3)
    assert 0.0 < short < long


def test_each_cpu_is_probed_and_the_callers_cpus_are_given_back() -> None:
    before = os.sched_getaffinity(0)
    probes = probe_each(before)
    assert sorted(probes) == sorted(before)
    assert all(ms > 0 for ms in probes.values())
    assert os.sched_getaffinity(0) == before


def test_the_probe_refuses_an_empty_measurement() -> None:
    with pytest.raises(ValueError, match="loops >= 1"):
        probe_ms(loops=0)


def test_the_fitted_ratio_is_the_ratio_where_the_probes_agree() -> None:
    # b is 5% slower than a at equal speed; a CPU twice as slow halves its tok/s.
    # Most pairs happened to give b the faster CPU.
    speeds = [0.6, 0.7, 0.8, 1.0, 1.3]
    ratios = [0.95 / s for s in speeds]
    assert at_equal_speed(ratios, speeds) == pytest.approx(0.95)
    # Without the fit, the median of these pairs says b is faster.
    assert statistics.median(ratios) > 1.1


def test_the_fit_ignores_noise_that_does_not_follow_the_probe() -> None:
    speeds = [0.8, 0.8, 1.25, 1.25]
    ratios = [1.02 / 0.8 * 1.01, 1.02 / 0.8 / 1.01, 1.02 / 1.25 * 1.01, 1.02 / 1.25 / 1.01]
    assert at_equal_speed(ratios, speeds) == pytest.approx(1.02)


@pytest.mark.parametrize(
    ("ratios", "speeds"),
    [
        ([1.0, 0.9], [1.0, 1.1]),  # too few pairs to fit
        ([1.0, 0.9, 0.95], [1.1, 1.1, 1.1]),  # probes that never differ say nothing
    ],
)
def test_no_fit_without_enough_spread(ratios: list[float], speeds: list[float]) -> None:
    assert at_equal_speed(ratios, speeds) is None


def test_one_speed_per_pair() -> None:
    with pytest.raises(ValueError, match="one speed ratio per pair"):
        at_equal_speed([1.0, 1.0, 1.0], [1.0, 1.0])


def test_a_nonpositive_figure_gives_no_fit() -> None:
    assert at_equal_speed([1.0, 0.0, 1.0], [1.0, 1.1, 0.9]) is None
    assert at_equal_speed([1.0, 0.9, 1.1], [1.0, 0.0, 0.9]) is None

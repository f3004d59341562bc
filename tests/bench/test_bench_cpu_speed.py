"""bench.cpu_speed: the probe on every CPU at once, and on one CPU while others spin."""

from __future__ import annotations

import os

from bench.cpu_speed import all_cpus, interference


def test_every_cpu_is_probed_and_summarized() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    report = all_cpus(seconds=0.6)
    assert sorted(report["cpus"]) == cpus
    for figures in report["cpus"].values():
        assert 0.0 < figures["min_ms"] <= figures["median_ms"] <= figures["max_ms"]
    first = report["cpus"][cpus[0]]["correlation_with_first"]
    assert first is None or abs(first - 1.0) < 1e-9  # CPU 0 follows itself


def test_interference_probes_each_set_in_each_round_and_gives_the_cpus_back() -> None:
    cpus = sorted(os.sched_getaffinity(0))
    before = os.sched_getaffinity(0)
    busy = [[], cpus[-1:]] if len(cpus) > 1 else [[]]
    out = interference(cpus[0], busy, hold_s=0.1, rounds=2)
    assert list(out) == (["none", str(cpus[-1])] if len(cpus) > 1 else ["none"])
    assert all(len(medians) == 2 and all(m > 0 for m in medians) for medians in out.values())
    assert os.sched_getaffinity(0) == before

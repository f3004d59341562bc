"""How fast the CPUs run Python right now, and a pair's ratio at equal CPU speed.

On the virtual GPU machines the benches ran on, one fixed piece of pure-Python work took
from 0.9 to 2.1 ms within seconds, on an otherwise idle CPU, whatever this machine's own
load (`git show edd6206:bench/results/2026-11-23-H100-cpu-speed/README.md`). The GPU's
own times held steady (a captured decode step replayed in 1.81-1.87 ms, run after run).
The engines' steps are host-bound, so a run's tok/s follows the speed its CPU happened to
have: the decode step of one 32-job run correlated 0.72 with this probe taken around it.

The speed moves on each CPU apart from the others (the quarter-second medians of CPUs
probed at once correlated -0.2 to 0.3 with each other's), so a probe speaks for its own
CPU only. `bench.paired` probes each of the system's CPUs right before and right after
each run, and keeps the probes of the CPU its stepping thread ran on. A pair whose two
runs met different speeds compares the CPUs as much as the systems;
`at_equal_speed` fits the pairs' log ratios against the log ratio of their probes and
gives the ratio where the probes agree.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from collections.abc import Iterable, Sequence

PROBE_LOOPS = 20_000  # about 1 ms of CPython on the H100 machine's CPUs when they run fast
PROBE_REPEATS = 3


def _work(loops: int) -> int:
    total = 0
    for i in range(loops):
        total += i * i
    return total


def probe_ms(loops: int = PROBE_LOOPS, repeats: int = PROBE_REPEATS) -> float:
    """Milliseconds the fixed work took on the calling thread: the fastest of `repeats`, so
    an interrupt or a preemption in one of them does not count."""
    if loops < 1 or repeats < 1:
        raise ValueError("probe_ms needs loops >= 1 and repeats >= 1")
    best = math.inf
    for _ in range(repeats):
        started = time.perf_counter()
        _work(loops)
        best = min(best, time.perf_counter() - started)
    return best * 1000.0


def probe_each(cpus: Iterable[int]) -> dict[int, float]:
    """probe_ms on each of these CPUs in turn (the calling thread moved there and back)."""
    before = os.sched_getaffinity(0)
    try:
        out = {}
        for cpu in sorted(cpus):
            os.sched_setaffinity(0, {cpu})
            out[cpu] = probe_ms()
        return out
    finally:
        os.sched_setaffinity(0, before)


def at_equal_speed(ratios: Sequence[float], speed_ratios: Sequence[float]) -> float | None:
    """The ratio (system b / system a) where both runs of a pair met the same CPU speed.

    ``ratios[i]`` is pair i's b/a ratio of a figure that scales with speed (tok/s),
    ``speed_ratios[i]`` the b/a ratio of the probes around its runs (probe ms: above 1,
    b's CPU was slower). Least squares of log ratio on log speed ratio; the intercept is
    the answer. None with fewer than 3 pairs or with probes that never differed."""
    if len(ratios) != len(speed_ratios):
        raise ValueError("at_equal_speed: one speed ratio per pair")
    if len(ratios) < 3 or any(r <= 0 for r in ratios) or any(s <= 0 for s in speed_ratios):
        return None
    ys = [math.log(r) for r in ratios]
    xs = [math.log(s) for s in speed_ratios]
    if statistics.pvariance(xs) == 0.0:
        return None
    fit = statistics.linear_regression(xs, ys)
    return math.exp(fit.intercept)

"""Is this machine's CPU speed steady, and does its own load move it? No GPU needed.

    python -m bench.cpu_speed --seconds 12 --out cpu-speed.json

- every CPU at once: each CPU times bench.cpu_probe's work every 20 ms; per CPU the
  median, fastest and slowest probe, and how its quarter-second medians follow CPU 0's;
- interference: the probe on one CPU (--probe-cpu) while the CPUs of each --busy set spin
  (pure-Python loops, as clients and Redis load a CPU), each set for --hold seconds, over
  --rounds rounds. If the probe only slows when a set spins, the machine's own load sets
  its speed; if it moves as much with nothing spinning, something outside does.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import time
from collections import defaultdict
from multiprocessing.synchronize import Event as EventType
from pathlib import Path
from typing import Any

from bench.cpu_probe import probe_ms
from bench.placement import parse_cpus

PROBE_EVERY_S = 0.02
WINDOW_S = 0.25


def _probe_series(seconds: float) -> list[tuple[float, float]]:
    """(wall time, probe ms) every PROBE_EVERY_S for `seconds`, on the calling thread."""
    series = []
    end = time.time() + seconds
    while time.time() < end:
        series.append((time.time(), probe_ms(repeats=1)))
        time.sleep(PROBE_EVERY_S)
    return series


def _probe_on(cpu: int, seconds: float, results: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    results.put((cpu, _probe_series(seconds)))


def all_cpus(seconds: float) -> dict[str, Any]:
    """Every allowed CPU probed at once."""
    cpus = sorted(os.sched_getaffinity(0))
    results: Any = mp.Queue()
    procs = [mp.Process(target=_probe_on, args=(cpu, seconds, results)) for cpu in cpus]
    for p in procs:
        p.start()
    series = dict(results.get() for _ in procs)
    for p in procs:
        p.join()
    start = min(t for s in series.values() for t, _ in s)
    windows: dict[int, dict[int, list[float]]] = defaultdict(lambda: defaultdict(list))
    for cpu, s in series.items():
        for t, ms in s:
            windows[int((t - start) / WINDOW_S)][cpu].append(ms)
    full = [w for _, w in sorted(windows.items()) if len(w) == len(cpus)]
    medians = {cpu: [statistics.median(w[cpu]) for w in full] for cpu in cpus}
    first = medians[cpus[0]]
    per_cpu = {}
    for cpu, s in series.items():
        probes = [ms for _, ms in s]
        follows = medians[cpu]
        per_cpu[cpu] = {
            "median_ms": statistics.median(probes),
            "min_ms": min(probes),
            "max_ms": max(probes),
            "correlation_with_first": (
                statistics.correlation(follows, first)
                if len(full) >= 3 and len(set(follows)) > 1 and len(set(first)) > 1
                else None
            ),
        }
    return {"seconds": seconds, "windows": len(full), "cpus": per_cpu}


def _spin(cpu: int, stop: EventType) -> None:
    os.sched_setaffinity(0, {cpu})
    table: dict[int, int] = {}
    while not stop.is_set():
        for i in range(5000):
            table[i % 97] = i * i


def interference(
    probe_cpu: int, busy_sets: list[list[int]], hold_s: float, rounds: int
) -> dict[str, list[float]]:
    """The probe's median on probe_cpu while each set of CPUs spins, per round."""
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {probe_cpu})
    out: dict[str, list[float]] = {_name(busy): [] for busy in busy_sets}
    try:
        for _ in range(rounds):
            for busy in busy_sets:
                stop = mp.Event()
                spinners = [mp.Process(target=_spin, args=(cpu, stop)) for cpu in busy]
                for p in spinners:
                    p.start()
                try:
                    time.sleep(0.2 if busy else 0.0)  # the spinners get going
                    out[_name(busy)].append(
                        statistics.median(ms for _, ms in _probe_series(hold_s))
                    )
                finally:
                    stop.set()
                    for p in spinners:
                        p.join()
    finally:
        os.sched_setaffinity(0, before)
    return out


def _name(busy: list[int]) -> str:
    return ",".join(map(str, busy)) or "none"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--seconds", type=float, default=12.0, help="every CPU at once, this long")
    ap.add_argument("--probe-cpu", type=int, default=0)
    ap.add_argument(
        "--busy",
        nargs="*",
        default=["none", "4", "4-5", "4-7", "4-15", "1", "1-3"],
        help="sets of CPUs to spin in turn, e.g. 4-7 or 1,3; 'none' for none",
    )
    ap.add_argument("--hold", type=float, default=2.0, help="seconds per set")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    allowed = os.sched_getaffinity(0)
    busy_sets = [[] if spec == "none" else sorted(parse_cpus(spec)) for spec in args.busy]
    busy_sets = [b for b in busy_sets if set(b) <= allowed and args.probe_cpu not in b]
    every = all_cpus(args.seconds)
    for cpu, figures in sorted(every["cpus"].items()):
        corr = figures["correlation_with_first"]
        print(
            f"CPU {cpu}: probe median {figures['median_ms']:.2f} ms "
            f"({figures['min_ms']:.2f}-{figures['max_ms']:.2f}), "
            f"follows CPU {min(every['cpus'])}: {'-' if corr is None else f'{corr:.2f}'}"
        )
    load = interference(args.probe_cpu, busy_sets, args.hold, args.rounds)
    for name, medians in load.items():
        print(
            f"probe on CPU {args.probe_cpu}, spinning {name}: "
            + " / ".join(f"{m:.2f}" for m in medians)
            + " ms"
        )
    if args.out:
        args.out.write_text(json.dumps({"all_cpus": every, "interference": load}, indent=1))


if __name__ == "__main__":
    main()

"""The GPU's clocks around a bench run, read through NVML by a process of their own.

A burst's first (prefill) step ran at one of two speeds for the same work (near 43 or
near 49 ms for a 1B 32-job burst on the H100, 13-27 ms for 8 jobs on an H200), and a run's
decode steps too; the GPU's clocks were never recorded beside them. `ClockRecorder`
starts a sampler process (pinned where the caller says, so the systems' CPUs stay
undisturbed) that reads the SM clock, the memory clock, the board's power draw and the
reasons NVML gives for holding the clocks down, every `interval_ms`, stamped with
`time.perf_counter()`: on Linux that is CLOCK_MONOTONIC, one clock across processes, so
the samples line up with the bench's and the worker's timings. The samples go to a file
of fixed-size records; the bench reads the window of a run after it ends, so nothing is
read while a run is timed.

    python -m bench.gpu_clocks --seconds 2      # the clocks now, a sample every ms
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# perf_counter (s), SM clock (MHz), memory clock (MHz), power (mW), clock event reasons.
RECORD = struct.Struct("<dIIIQ")
INTERVAL_MS = 1.0
IDLE_WINDOW_S = 0.09  # the bench idles IDLE_BEFORE_RUN_S (0.1 s) before each burst
# NVML's clock event reasons (nvmlClocksEventReason*), by bit.
REASONS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}


@dataclass(frozen=True)
class Sample:
    t: float  # perf_counter seconds
    sm_mhz: int
    mem_mhz: int
    power_mw: int
    reasons: int


def reason_names(bits: int) -> list[str]:
    """NVML's reasons for holding the clocks down, by name; unknown bits as hex."""
    names = [name for bit, name in REASONS.items() if bits & bit]
    rest = bits & ~sum(REASONS)
    return names + ([hex(rest)] if rest else [])


def read_samples(path: Path, offset: int = 0) -> tuple[list[Sample], int]:
    """The whole records in `path` from byte `offset`, and the offset after them (a record
    still being written is left for the next read)."""
    with path.open("rb") as f:
        f.seek(offset)
        data = f.read()
    whole = len(data) - len(data) % RECORD.size
    samples = [Sample(*fields) for fields in RECORD.iter_unpack(data[:whole])]
    return samples, offset + whole


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def window(samples: Sequence[Sample], start: float, end: float) -> list[Sample]:
    return [s for s in samples if start <= s.t <= end]


def run_figures(
    samples: Sequence[Sample], t0: float, first_ms: float, end: float
) -> dict[str, Any]:
    """What the clocks did around one burst that began at `t0` (perf_counter s) and ended
    at `end`: in the idle `IDLE_WINDOW_S` before it, up to `first_ms` after it (its first
    step, say) and over the whole run."""
    idle = window(samples, t0 - IDLE_WINDOW_S, t0)
    first = window(samples, t0, t0 + first_ms / 1000)
    run = window(samples, t0, end)
    bits = 0
    for s in run:
        bits |= s.reasons
    gaps = [b.t - a.t for a, b in itertools.pairwise(run)]
    return {
        "gpu_sm_mhz_idle": _median([s.sm_mhz for s in idle]),
        "gpu_sm_mhz_first": _median([s.sm_mhz for s in first]),
        "gpu_sm_mhz_first_min": min((s.sm_mhz for s in first), default=None),
        "gpu_sm_mhz_run": _median([s.sm_mhz for s in run]),
        "gpu_mem_mhz_run": _median([s.mem_mhz for s in run]),
        "gpu_power_w_run": _median([s.power_mw / 1000 for s in run]),
        "gpu_power_w_max": max((s.power_mw / 1000 for s in run), default=None),
        "gpu_clock_reasons": reason_names(bits),
        "gpu_samples": len(run),
        "gpu_sample_gap_ms_max": round(max(gaps) * 1000, 2) if gaps else None,
    }


def timeline(samples: Sequence[Sample], t0: float, start: float, end: float) -> list[list[float]]:
    """The samples between `start` and `end` as [ms after t0, SM MHz, memory MHz, W, reasons]."""
    return [
        [round((s.t - t0) * 1000, 2), s.sm_mhz, s.mem_mhz, s.power_mw / 1000, s.reasons]
        for s in window(samples, start, end)
    ]


class ClockRecorder:
    """The sampler process, and the samples it has written so far. Where NVML cannot be
    read (no pynvml, no driver), `unavailable` says why and every read returns nothing."""

    def __init__(self, cpus: frozenset[int] | None = None, interval_ms: float = INTERVAL_MS):
        self.cpus, self.interval_ms = cpus, interval_ms
        self.unavailable: str | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir = tempfile.TemporaryDirectory(prefix="exlq-gpu-clocks-", dir=_fast_dir())
        self.path = Path(self._dir.name) / "samples.bin"
        self._offset = 0
        self._kept: list[Sample] = []

    def __enter__(self) -> ClockRecorder:
        self.path.touch()
        cmd = [sys.executable, "-m", "bench.gpu_clocks", "--sample", str(self.path)]
        cmd += ["--interval-ms", str(self.interval_ms)]
        self._proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        if self.cpus:  # placed from here: a preexec_fn is unsafe in a process with threads
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(self._proc.pid, self.cpus)
        deadline = time.monotonic() + 20
        while self.path.stat().st_size < RECORD.size:
            if self._proc.poll() is not None:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                self.unavailable = err.strip().splitlines()[-1] if err.strip() else "exited"
                break
            if time.monotonic() > deadline:
                self.unavailable = "no sample in 20 s"
                break
            time.sleep(0.01)
        return self

    def __exit__(self, *exc: object) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=5)
            if self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
        if self._proc is not None and self._proc.stderr:
            self._proc.stderr.close()
        self._dir.cleanup()

    def around(self, t0: float) -> list[Sample]:
        """The samples from the second before a burst that began at `t0` on."""
        return self.since(t0 - 1.0)

    def since(self, start: float) -> list[Sample]:
        """The samples from perf_counter time `start` on (older ones are dropped)."""
        if self.unavailable is None:
            new, self._offset = read_samples(self.path, self._offset)
            self._kept.extend(new)
        self._kept = [s for s in self._kept if s.t >= start]
        return list(self._kept)


def _fast_dir() -> str | None:
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def _nvml_reader(index: int) -> Iterator[tuple[int, int, int, int]]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    handle = pynvml.nvmlDeviceGetHandleByIndex(index)
    reasons = getattr(
        pynvml,
        "nvmlDeviceGetCurrentClocksEventReasons",
        getattr(pynvml, "nvmlDeviceGetCurrentClocksThrottleReasons", None),
    )
    while True:
        yield (
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_SM),
            pynvml.nvmlDeviceGetClockInfo(handle, pynvml.NVML_CLOCK_MEM),
            pynvml.nvmlDeviceGetPowerUsage(handle),
            reasons(handle) if reasons else 0,
        )


def _gpu_index() -> int:
    """NVML numbers every GPU of the host; CUDA_VISIBLE_DEVICES may name one by number."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def sample(path: Path, interval_ms: float) -> None:
    """The sampler: a record every interval_ms, appended to `path`, until killed or
    orphaned."""
    parent = os.getppid()
    reader = _nvml_reader(_gpu_index())
    interval = interval_ms / 1000
    with path.open("ab", buffering=0) as out:
        due = time.perf_counter()
        while os.getppid() == parent:
            t = time.perf_counter()
            out.write(RECORD.pack(t, *next(reader)))
            due = max(due + interval, time.perf_counter())
            time.sleep(max(0.0, due - time.perf_counter()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--sample", type=Path, help=argparse.SUPPRESS)  # the sampler process
    ap.add_argument("--interval-ms", type=float, default=INTERVAL_MS)
    ap.add_argument("--seconds", type=float, default=1.0, help="how long to show the clocks")
    args = ap.parse_args()
    if args.sample:
        sample(args.sample, args.interval_ms)
        return
    with ClockRecorder(interval_ms=args.interval_ms) as clocks:
        if clocks.unavailable:
            raise SystemExit(f"NVML unavailable: {clocks.unavailable}")
        start = time.perf_counter()
        time.sleep(args.seconds)
        samples = clocks.since(start)
    print(run_figures(samples, start, args.seconds * 1000, time.perf_counter()))


if __name__ == "__main__":
    main()

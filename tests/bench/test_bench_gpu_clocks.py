"""bench.gpu_clocks: the sampler's records read back by time window, what a run's window says,
and a recorder that says why it records nothing where NVML cannot be read."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench.gpu_clocks import (
    RECORD,
    ClockRecorder,
    Sample,
    read_samples,
    reason_names,
    run_figures,
    timeline,
)

IDLE_BIT, POWER_CAP_BIT = 0x1, 0x4


def _samples(t0: float) -> list[Sample]:
    """Idle at 345 MHz for 0.1 s before t0, then 1200 MHz for 20 ms, then 1980 MHz: one
    sample a millisecond."""
    out = []
    for i in range(-100, 200):
        t = t0 + i / 1000
        sm, reasons = (345, IDLE_BIT) if i < 0 else ((1200, 0) if i < 20 else (1980, 0))
        if i == 150:
            reasons = POWER_CAP_BIT
        out.append(Sample(t, sm, 3201, 100_000 if i < 0 else 450_000, reasons))
    return out


def test_records_are_read_back_whole_and_from_where_the_last_read_ended(tmp_path: Path) -> None:
    path = tmp_path / "samples.bin"
    first, second = Sample(1.0, 345, 3201, 90_000, 1), Sample(1.001, 1980, 3201, 500_000, 0)
    path.write_bytes(
        RECORD.pack(first.t, first.sm_mhz, first.mem_mhz, first.power_mw, first.reasons)
        + RECORD.pack(second.t, 1980, 3201, 500_000, 0)[:10]  # the sampler mid-write
    )
    samples, offset = read_samples(path)
    assert samples == [first]
    assert offset == RECORD.size
    path.write_bytes(path.read_bytes()[:offset] + RECORD.pack(second.t, 1980, 3201, 500_000, 0))
    samples, offset = read_samples(path, offset)
    assert samples == [second]
    assert offset == 2 * RECORD.size


def test_a_runs_figures_split_the_idle_before_it_its_first_step_and_the_whole_run() -> None:
    t0 = 1000.0
    figures = run_figures(_samples(t0), t0, first_ms=10.0, end=t0 + 0.199)
    assert figures["gpu_sm_mhz_idle"] == 345
    assert figures["gpu_sm_mhz_first"] == 1200  # the 11 samples of its first 10 ms
    assert figures["gpu_sm_mhz_first_min"] == 1200
    assert figures["gpu_sm_mhz_run"] == 1980
    assert figures["gpu_power_w_run"] == pytest.approx(450.0)
    assert figures["gpu_clock_reasons"] == ["sw_power_cap"]  # the idle before is not the run's
    assert figures["gpu_samples"] == 200
    assert figures["gpu_sample_gap_ms_max"] == pytest.approx(1.0, abs=0.01)


def test_a_run_without_samples_gives_no_figures_rather_than_failing() -> None:
    figures = run_figures([], 5.0, 10.0, 6.0)
    assert figures["gpu_sm_mhz_run"] is None
    assert figures["gpu_samples"] == 0
    assert figures["gpu_clock_reasons"] == []


def test_reason_bits_are_named_and_unknown_bits_kept() -> None:
    assert reason_names(0) == []
    assert reason_names(IDLE_BIT | POWER_CAP_BIT) == ["gpu_idle", "sw_power_cap"]
    assert reason_names(0x4000) == ["0x4000"]


def test_a_timeline_is_in_ms_after_the_bursts_start() -> None:
    t0 = 50.0
    rows = timeline(_samples(t0), t0, t0 - 0.002, t0 + 0.001)
    assert [row[0] for row in rows] == pytest.approx([-2.0, -1.0, 0.0, 1.0])
    assert [row[1] for row in rows] == [345, 345, 1200, 1200]
    assert rows[-1][3] == pytest.approx(450.0)


def test_the_recorder_samples_or_says_why_it_cannot() -> None:
    with ClockRecorder(interval_ms=1.0) as clocks:
        start = time.perf_counter()
        time.sleep(0.05)
        samples = clocks.since(start)
        if clocks.unavailable is None:  # a machine with NVML and a GPU
            assert len(samples) >= 10
            assert all(s.sm_mhz > 0 and s.t >= start for s in samples)
        else:  # CI: nvidia-ml-py installed, no driver; the sampler's own error is kept
            assert "NVML" in clocks.unavailable or "pynvml" in clocks.unavailable
            assert samples == []
    assert not clocks.path.exists()  # its file is gone with it

"""bench.paired: each pair of runs gives one ratio; the table reports their median and range."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.baselines import percentiles
from bench.paired import _stepper_probes, markdown, median_interval, pool, summarize

META = {
    "gpu": "GPU",
    "date": "2026-11-23",
    "shape": "1b",
    "prompt_tokens": 256,
    "max_new_tokens": 128,
    "cache_tokens": 65536,
    "cpus": "all",
    "command": "python -m bench.paired",
}


def _run(
    system: str,
    n: int,
    repeat: int,
    tok_s: float,
    ttft: float,
    build_ms: float = 0.0,
    step_ms: float = 2.0,
) -> dict[str, Any]:
    run = {
        "system": system,
        "concurrency": n,
        "repeat": repeat,
        "output_tokens_per_s": tok_s,
        "ttft_ms_p50": ttft,
        "step_ms_mean": step_ms,
    }
    if system == "exlq-engine":
        run["build_ms"] = build_ms
    return run


def test_ratios_are_taken_within_pairs_not_between_medians() -> None:
    runs = [
        # The machine drifts: pair 1 runs at half the speed of pair 0, in both systems.
        _run("exlq-engine", 8, 0, 1000.0, 20.0, build_ms=1.0),
        _run("exlq", 8, 0, 990.0, 23.0, step_ms=2.2),
        _run("exlq", 8, 1, 480.0, 30.0, step_ms=4.2),
        _run("exlq-engine", 8, 1, 500.0, 25.0, build_ms=3.0, step_ms=4.0),
        _run("exlq-engine", 8, 2, 800.0, 21.0, build_ms=2.0),
        _run("exlq", 8, 2, 800.0, 22.0),
        _run("exlq-engine", 1, 0, 400.0, 10.0),  # a pair left unfinished does not count
    ]
    [eight] = summarize(runs)
    assert eight["pairs"] == 3
    assert eight["ratios"] == pytest.approx([0.99, 0.96, 1.0])
    assert eight["ratio_median"] == 0.99
    assert (eight["ratio_min"], eight["ratio_max"]) == (0.96, 1.0)
    assert eight["pairs_at_or_above_0_97"] == 2
    assert eight["added_ttft_ms"] == [3.0, 5.0, 1.0]
    assert eight["added_ttft_ms_median"] == 3.0
    assert eight["engine_build_ms_median"] == 2.0  # inside the engine's TTFT
    assert eight["step_ratio_median"] == pytest.approx(1.05)  # 1.10, 1.05 and 1.00
    table = markdown([eight], META)
    # Runs without per-job times (files from before them): no job-by-job figure.
    assert eight["added_ttft_by_job_ms"] == [] and eight["added_ttft_by_job_ms_median"] is None
    assert eight["pairs_held_apart"] is None
    row = "| 8 | 3 | 800 | 800 | 0.990 (0.96-1.00) | 2 of 3 | 21.0 | 2.0 | 3.0 | - | 1.050 |"
    assert row in table
    assert "held back" not in table
    assert "stepping thread" not in table  # runs without thread figures: no such table


def _slices(first: float, second: float, held: int | None = None) -> list[float]:
    """First-token times of a 64-job burst started in two slices of 32; job ``held`` got
    its first token (held back, partial UTF-8) with the second slice's."""
    times = [first + j * 0.1 for j in range(32)] + [second + j * 0.1 for j in range(32)]
    if held is not None:
        times[held] = second + 5.0
    return times


def test_added_ttft_job_by_job_does_not_jump_with_a_held_back_first_token() -> None:
    # Pair 0: exlq adds 3 ms to every job, and one of its first slice's jobs is held back
    # (a greedy tie went the other way there): its p50 jumps by half a slice.
    # Pair 1: the same job is held back in both runs, exlq 2 ms later for every job.
    # Pair 2: no job held back; exlq 4 ms later, and one job got nothing at all.
    engine: list[list[float | None]] = [
        [*_slices(200.0, 320.0)],
        [*_slices(200.0, 320.0, held=5)],
        [*_slices(210.0, 330.0)],
    ]
    exlq: list[list[float | None]] = [
        [*_slices(203.0, 323.0, held=7)],
        [*_slices(202.0, 322.0, held=5)],
        [t + 4.0 for t in _slices(210.0, 330.0)],
    ]
    exlq[2][40] = None
    # How many tokens each job's first event carried: three where its text was held back.
    held = [(None, 7), (5, 5), (None, None)]
    runs = []
    for repeat, (e, b) in enumerate(zip(engine, exlq, strict=True)):
        for system, times, held_job in (
            ("exlq-engine", e, held[repeat][0]),
            ("exlq", b, held[repeat][1]),
        ):
            [p50] = percentiles([t for t in times if t is not None], [50])
            assert p50 is not None
            run = _run(system, 64, repeat, 1000.0, p50)
            run["ttft_ms_jobs"] = times
            run["first_event_tokens"] = [
                None if t is None else 3 if j == held_job else 1 for j, t in enumerate(times)
            ]
            runs.append(run)
    [row] = summarize(runs)
    assert row["added_ttft_ms"][0] > 50  # the p50s' difference jumped
    assert row["added_ttft_by_job_ms"] == pytest.approx([3.0, 2.0, 4.0])
    assert row["added_ttft_by_job_ms_median"] == pytest.approx(3.0)
    # Only pair 0 held back different jobs (pair 1 the same job in both runs).
    assert (row["pairs_held_apart"], row["pairs_counting_held"]) == (1, 3)
    table = markdown([row], META)
    assert "| 3.0 | 1.000 |" in table
    assert "held back the first tokens of different jobs" in table and "N=64: 1 of 3." in table


def test_the_stepping_threads_figures_are_paired_medians_in_a_table_of_their_own() -> None:
    runs = []
    for repeat, (alone_run, exlq_run, exlq_wait) in enumerate(
        [(900.0, 1000.0, 10.0), (950.0, 1100.0, 90.0), (1000.0, 1050.0, 30.0)]
    ):
        alone = _run("exlq-engine", 1, repeat, 400.0, 10.0)
        alone.update(
            stepper_run_us_per_step=alone_run,
            stepper_wait_us_per_step=1.0,
            stepper_preempted_per_step=0.01,
            others_run_us_per_step=5.0,
        )
        exlq = _run("exlq", 1, repeat, 380.0, 12.0)
        exlq.update(
            stepper_run_us_per_step=exlq_run,
            stepper_wait_us_per_step=exlq_wait,
            stepper_preempted_per_step=0.5,
            others_run_us_per_step=300.0,
        )
        runs += [alone, exlq]
    [one] = summarize(runs)
    assert one["threads"]["exlq-engine_stepper_run_us_per_step"] == 950.0
    assert one["threads"]["exlq_stepper_run_us_per_step"] == 1050.0
    assert one["threads"]["exlq_stepper_wait_us_per_step"] == 30.0
    table = markdown([one], META)
    assert "| 1 | 950 / 1 / 0.01 | 5 | 1,050 / 30 / 0.50 | 300 |" in table


def test_pairs_are_also_read_at_equal_cpu_speed() -> None:
    runs = []
    # exlq is 4% slower and 3 ms later at equal speed; each pair's runs met CPUs of
    # different speeds, and a CPU s times slower (probe s times longer) divides tok/s by s
    # and multiplies TTFT by s.
    for repeat, (engine_probe, exlq_probe) in enumerate(
        [(1.0, 1.5), (1.0, 1.05), (1.6, 1.0), (1.2, 1.2), (1.0, 2.0)]
    ):
        alone = _run("exlq-engine", 32, repeat, 6000.0 / engine_probe, 50.0 * engine_probe)
        exlq = _run("exlq", 32, repeat, 5760.0 / exlq_probe, 53.0 * exlq_probe)
        alone["cpu_probe_ms"] = [engine_probe, engine_probe]
        exlq["cpu_probe_ms"] = [exlq_probe * 0.9, exlq_probe * 1.1]  # the mean is the run's
        runs += [alone, exlq]
    runs.append(_run("exlq-engine", 32, 9, 6000.0, 50.0))  # no probes: an older file's pair
    runs.append(_run("exlq", 32, 9, 5760.0, 53.0))
    [point] = summarize(runs)
    assert point["ratio_at_equal_speed"] == pytest.approx(0.96)
    assert point["cpu_speed_ratios"] == pytest.approx([1.5, 1.05, 0.625, 1.0, 2.0])
    # Matched within 10%: the pairs at 1.05 and 1.0.
    assert point["matched_pairs"] == 2
    assert point["ratio_median_matched"] == pytest.approx((0.96 / 1.05 + 0.96) / 2)
    engine_ttft = point["engine_ttft_ms_p50"]
    assert point["added_ttft_ms_at_equal_speed"] == pytest.approx(engine_ttft * 0.06)
    table = markdown([point], META)
    assert "At equal CPU speed" in table
    assert f"| 32 | 0.960 | {engine_ttft * 0.06:.1f} | 2 of 5 |" in table


def test_a_runs_probes_are_those_of_its_stepping_threads_cpu() -> None:
    before, after = {0: 1.0, 1: 2.0}, {0: 1.2, 1: 1.8}
    assert _stepper_probes({"stepper_cpu": 1}, before, after) == [2.0, 1.8]
    # The stepping thread's CPU unknown (-1), or outside the probed ones: their mean.
    for row in ({"stepper_cpu": -1}, {"stepper_cpu": 7}, {}):
        assert _stepper_probes(row, before, after) == pytest.approx([1.5, 1.5])


def test_runs_without_probes_give_no_equal_speed_table() -> None:
    runs = [_run("exlq-engine", 8, r, 1000.0, 20.0) for r in range(4)]
    runs += [_run("exlq", 8, r, 950.0, 22.0) for r in range(4)]
    [eight] = summarize(runs)
    assert eight["ratio_at_equal_speed"] is None
    assert eight["matched_pairs"] == 0
    assert "At equal CPU speed" not in markdown([eight], META)


def test_pooled_calls_keep_their_pairs_apart(tmp_path: Path) -> None:
    meta = {"shape": "1b", "command": "python -m bench.paired --shape 1b", "date": "2026-11-23"}
    # Two calls on different machines, both numbering their repeats from 0.
    first = [_run("exlq-engine", 8, 0, 1000.0, 20.0), _run("exlq", 8, 0, 950.0, 24.0)]
    second = [_run("exlq", 8, 0, 510.0, 30.0), _run("exlq-engine", 8, 0, 500.0, 28.0)]
    paths = []
    for name, runs in (("call-1.json", first), ("call-2.json", second)):
        (tmp_path / name).write_text(json.dumps({"meta": meta, "runs": runs}))
        paths.append(tmp_path / name)
    runs, pooled_meta = pool(paths)
    [eight] = summarize(runs)
    assert eight["pairs"] == 2
    assert sorted(eight["ratios"]) == pytest.approx([0.95, 1.02])  # never 950 / 500
    assert "--pool call-1.json call-2.json" in pooled_meta["command"]


def test_pooling_files_of_two_shapes_is_refused(tmp_path: Path) -> None:
    for shape in ("1b", "8b"):
        meta = {"shape": shape, "command": "c", "date": "d"}
        (tmp_path / f"{shape}.json").write_text(json.dumps({"meta": meta, "runs": []}))
    with pytest.raises(SystemExit, match="different shapes"):
        pool([tmp_path / "1b.json", tmp_path / "8b.json"])


def test_the_worker_starts_with_the_engine_alones_options_as_its_cli_takes_them(
    tmp_path: Path,
) -> None:
    """ExlqPath's arguments are flags of `exlq worker`, and its -o pairs parse into the
    exllamav2 engine's options with the values the engine alone was given."""
    from typer.testing import CliRunner

    from bench.exlq_path import EngineOptions, ExlqPath, worker_options
    from exlq.cli import app
    from exlq.worker.cli import engine_options as option_pairs
    from exlq.worker.engines.registry import find

    alone: EngineOptions = {
        "cache_tokens": 16384,
        "prefill_batch_tokens": 0,
        "admit_prompt_tokens": 4096,
        "gpu_embedding": False,
    }
    path = ExlqPath(tmp_path, max_batch_size=4, options=worker_options(alone))
    worker_help = CliRunner().invoke(app, ["worker", "--help"], env={"COLUMNS": "200"}).output
    for flag in (arg for arg in path.args if arg.startswith("-")):
        assert flag in worker_help, flag
    pairs = [path.args[i + 1] for i, arg in enumerate(path.args) if arg == "-o"]
    settings = find("exllamav2").options(option_pairs(pairs))
    assert {name: getattr(settings, name) for name in alone} == alone
    assert settings.attention == "exlq"  # the kernel the engine alone installs
    assert path.env == {"EXLQ_ENGINE_RUNNER": "process"}


def _clocked_run(system: str, repeat: int, sm_first: int, reasons: list[str]) -> dict[str, Any]:
    return _run(system, 32, repeat, 1000.0, 50.0, step_ms=3.0) | {
        "gpu_sm_mhz_idle": 345,
        "gpu_sm_mhz_first": sm_first,
        "gpu_sm_mhz_run": 1980,
        "gpu_power_w_run": 400.0,
        "gpu_clock_reasons": reasons,
    }


def test_the_paired_table_gives_each_systems_clocks_and_every_reason_seen() -> None:
    runs = [
        _clocked_run("exlq-engine", 0, 1500, []),
        _clocked_run("exlq", 0, 1300, ["sw_power_cap"]),
        _clocked_run("exlq-engine", 1, 1700, []),
        _clocked_run("exlq", 1, 1900, []),
    ]
    [row] = summarize(runs)
    assert row["gpu_clocks"]["exlq-engine_gpu_sm_mhz_first"] == 1600
    assert row["gpu_clocks"]["exlq_gpu_sm_mhz_first"] == 1600
    assert row["gpu_clock_reasons"] == ["sw_power_cap"]
    table = markdown([row], META)
    assert "| 32 | 345 / 1,600 / 1,980 | 400 | 345 / 1,600 / 1,980 | 400 | sw_power_cap |" in table


def test_each_paired_median_comes_with_a_bootstrap_interval_the_same_each_time() -> None:
    spread = [0.90, 0.95, 0.97, 0.98, 0.99, 1.00, 1.01, 1.02, 1.05, 1.20]
    lo, hi = median_interval(spread) or (0.0, 0.0)
    assert 0.90 < lo < 0.985 < hi < 1.20  # around the median (0.985), inside the range
    assert median_interval(spread) == (lo, hi)  # seeded: a file's intervals never move
    assert median_interval([1.0] * 5) == (1.0, 1.0)
    assert median_interval([1.0]) is None  # one pair: no interval
    # More pairs of the same spread: a narrower interval.
    lo40, hi40 = median_interval(spread * 4) or (0.0, 0.0)
    assert hi40 - lo40 < hi - lo

    runs = []
    for repeat, ratio in enumerate(spread):
        runs += [
            _run("exlq-engine", 8, repeat, 1000.0, 20.0),
            _run("exlq", 8, repeat, 1000.0 * ratio, 20.0 + 10 * (ratio - 1)),
        ]
    [row] = summarize(runs)
    assert row["intervals"]["ratio"] == pytest.approx((lo, hi))
    assert row["intervals"]["added_ttft_by_job_ms"] is None  # no per-job times in these runs
    table = markdown([row], META)
    assert f"| 8 | 10 | {lo:.3f} to {hi:.3f} | " in table and " | - |" in table

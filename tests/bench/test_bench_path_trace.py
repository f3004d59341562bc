"""bench.path_trace reads a run's timeline from the worker's trace file (both of its
processes, exlq.worker.tracing) beside what the client saw (on the echo engine)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import path_trace
from bench.baselines import random_prompt_ids
from bench.exlq_path import ExlqPath
from bench.gpu_clocks import ClockRecorder
from bench.placement import Placement
from exlq.worker.runner import ACCEPT_PIECE

pytestmark = pytest.mark.integration


def test_a_traced_run_gives_each_stage_of_the_path_in_order(
    tmp_path: Path, echo_bench_model: Path
) -> None:
    model = echo_bench_model
    trace = tmp_path / "trace.jsonl"
    jobs = ACCEPT_PIECE + 8
    args = argparse.Namespace(
        admit_prompt_tokens=32 * 16, prompt_tokens=16, max_new_tokens=4, steps_shown=8
    )
    with (
        ClockRecorder() as clocks,
        ExlqPath(model, max_batch_size=64, engine="echo", trace_file=trace) as path,
        path_trace.TracedSystems(
            args, Placement(server=None, load=None), trace, None, path, clocks
        ) as systems,
    ):
        record = systems.run_exlq(
            random_prompt_ids(model, jobs, 16, seed=3), random_prompt_ids(model, jobs, 16, seed=4)
        )
    # The GPU's clocks beside the steps where NVML answers (none in CI: no driver).
    assert ("gpu_clocks" in record) == (clocks.unavailable is None)
    assert record["system"] == "exlq"
    # The burst came in pieces (a piece begins with what one read brought and gathers the
    # rest of its 32); each was offered and admitted to the engine process, which read each
    # admit and added its jobs.
    assert len(record["pieces_begun"]) >= 2
    assert sum(n for _, n in record["jobs_added"]) == jobs
    assert len(record["admits_sent"]) == len(record["jobs_added"])
    assert len(record["parses"]) == 8
    kinds = [kind for _, kind in record["commands_read"]]
    assert kinds[0] == "offer" and "admit" in kinds
    assert record["steps"] and record["steps"][0][2] > 0  # the first step ran jobs
    # A median first token per admission slice of 32 jobs.
    assert len(record["first_token_by_group"]) == 2
    table = path_trace.stage_table([record | {"n": jobs}])
    cells = {
        row[1].strip().removeprefix("exlq: "): row[2].strip()
        for row in (line.split("|") for line in table.splitlines() if "| exlq:" in line)
    }
    assert list(cells) == [label for label, _ in path_trace.STAGES]
    # The idle engine builds ahead only between an offer and its admit; when the last offer
    # and the admit reach it together, that stage has no value ("-"). The start script may
    # answer before or after the first step: the engine starts a piece before its verdict.
    built = cells.pop("the idle engine has built ahead")
    answered = float(cells.pop("the start script answers"))
    ms = {label: float(cell) for label, cell in cells.items()}
    # In order, but for the races of two processes: the engine process may read the admit
    # before the worker notes its send, and the client may read an event before the
    # commit script's reply reaches the worker.
    way_in = [
        "the worker starts on the first piece",
        "it has parsed the first job",
        "it offers the first job to the engine process",
        "it admits the piece (the hand-over)",
    ]
    engine_side = [
        "the engine process reads the admit",
        "the engine has added the piece's jobs",
        "the first step begins",
        "the first step ends",
        "the engine process sends its report",
        "its report reaches the worker's event loop",
        "the worker calls the commit script",
        "its events are in Redis (the script returns)",
    ]
    for stages in (way_in, engine_side):
        times = [ms[stage] for stage in stages]
        assert times == sorted(times), stages
    assert ms["it has parsed the first job"] <= answered
    assert ms["the worker starts on the first piece"] <= ms["the engine process reads the admit"]
    offers_prepared = ms["the engine has prepared the offers before it"]
    assert ms["it offers the first job to the engine process"] <= offers_prepared
    assert offers_prepared <= ms["the engine has added the piece's jobs"]
    if built != "-":
        assert float(built) <= ms["the engine has added the piece's jobs"]
    commit_called = ms["the worker calls the commit script"]
    assert commit_called <= ms["the median job's first token reaches the client"]


def test_group_medians_are_per_slice_of_jobs_in_submit_order() -> None:
    # The worker's default budget holds 32 prompts of 256 tokens: one full group 1 ms
    # apart from 0 ms, then a group of two.
    group = path_trace.slice_jobs(8192, 256, jobs=34)
    assert group == 32
    first: list[float | None] = [float(i) for i in range(group)] + [1000.0, 1002.0]
    assert path_trace.group_medians(first, group) == [15.5, 1001.0]
    assert path_trace.slice_jobs(0, 256, jobs=34) == 34  # no budget: one slice
    # A job that made no token is left out of its group's median.
    assert path_trace.group_medians([1.0, None, 3.0], 3) == [2.0]

"""bench.path_trace records a run's timeline in the worker, its engine process and the SDK
(on the echo engine), and puts back what it wrapped."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from bench import path_trace
from bench.baselines import random_prompt_ids
from bench.exlq_path import ExlqPath
from bench.gpu_clocks import ClockRecorder
from bench.placement import Placement
from exlq.producer.submit_batch import SubmitBatcher
from exlq.producer.subscriber import EventRouter
from exlq.worker.runner import ACCEPT_PIECE

pytestmark = pytest.mark.integration


def test_a_traced_run_gives_each_stage_of_the_path_in_order(
    tmp_path: Path, echo_bench_model: Path
) -> None:
    model = echo_bench_model
    trace_dir = tmp_path / "trace"
    trace_dir.mkdir()
    jobs = ACCEPT_PIECE + 8
    originals = (EventRouter._push, SubmitBatcher._send)
    with (
        path_trace.BenchTrace() as bench_trace,
        ClockRecorder() as clocks,
        ExlqPath(
            model,
            max_batch_size=64,
            engine="echo",
            worker_module="bench.path_trace",
            worker_env={path_trace.TRACE_ENV: str(trace_dir)},
        ) as path,
    ):
        row = path.run(
            random_prompt_ids(model, jobs, 16, seed=1),
            random_prompt_ids(model, jobs, 16, seed=2),
            max_new_tokens=4,
        )
        t0, times, _, sdk_first = bench_trace.take()
        sends = bench_trace.last_sends
        # The same again as `python -m bench.path_trace` records it: slices of 32 prompts.
        systems = path_trace.TracedSystems(
            argparse.Namespace(
                admit_prompt_tokens=32 * 16, prompt_tokens=16, max_new_tokens=4, steps_shown=8
            ),
            Placement(server=None, load=None),
            trace_dir,
            bench_trace,
            engine=None,
            path=path,
            engine_class=None,
            clocks=clocks,
        )
        record = systems.run_exlq(
            random_prompt_ids(model, jobs, 16, seed=3), random_prompt_ids(model, jobs, 16, seed=4)
        )
    assert (EventRouter._push, SubmitBatcher._send) == originals
    # The GPU's clocks beside the steps where NVML answers (none in CI: no driver).
    assert ("gpu_clocks" in record) == (clocks.unavailable is None)
    assert row["completion_tokens"] == 4 * jobs
    # Both of the worker's processes wrote their records.
    assert len(list(trace_dir.glob("*.jsonl"))) == 2
    timeline = path_trace.exlq_timeline(
        path_trace.read_worker_trace(trace_dir, t0, t0 + row["wall_s"]), t0, steps_shown=8
    )
    # The SDK sent the burst in pieces, and every job's first event reached it.
    assert sum(n for _, _, n in sends) == jobs
    assert len(sdk_first) == jobs
    # Each piece the worker accepted was handed over and received by the engine process.
    assert len(timeline["pieces_handed"]) == len(timeline["engine_recv"]) >= 2
    assert sum(n for *_, n in timeline["engine_apply"]) == jobs
    first_step_begin = timeline["steps"][0][0]
    # (The engine process may note its receipt before the worker notes its send's end.)
    assert timeline["pieces_begin"][0] <= timeline["engine_recv"][0] <= first_step_begin
    # The first job is parsed once the worker starts on the piece, before its hand-over.
    assert len(timeline["parses"]) == 8
    assert timeline["pieces_begin"][0] <= timeline["parses"][0] <= timeline["pieces_handed"][0]
    assert first_step_begin <= timeline["reports_in"][0][0] <= timeline["commits_end"][0]
    # The first step's chunks are the first token of the jobs it ran.
    assert timeline["steps"][0][3] == timeline["steps"][0][2] > 0
    groups = path_trace.group_medians([tt[0] for tt in times], t0, ACCEPT_PIECE)
    assert len(groups) == 2 and groups[0] <= groups[1]
    # The recorded run: a median per slice, every stage of the table read, in order.
    assert len(record["first_token_by_group"]) == 2
    assert sum(n for *_, n in record["sdk_sends"]) == jobs
    table = path_trace.stage_table([record | {"n": jobs}])
    cells = {
        row[1].strip().removeprefix("exlq: "): row[2].strip()
        for row in (line.split("|") for line in table.splitlines() if "| exlq:" in line)
    }
    assert list(cells) == [label for label, _ in path_trace.STAGES]
    # The engine builds ahead only when it is idle between an offer and its admit; when the
    # last part and the admit reach it together, that stage has no value ("-").
    built = cells.pop("offered: the engine has built ahead")
    built_ahead = None if built == "-" else float(built)
    ms = {label: float(cell) for label, cell in cells.items()}
    # In order, but for the races of two processes: the engine may note its receipt before
    # the worker notes its send's end, and the SDK may read an event before the commit's reply.
    way_in = [
        ms["the SDK starts writing the first piece"],
        ms["the worker's read returns it"],
        ms["the worker starts on the piece"],
        ms["parsed, started in Redis, handed to the pipe"],
    ]
    engine_side = [
        ms["the engine process has it"],
        ms["the engine has added it"],
        ms["the first step begins"],
        ms["the first step ends"],
        ms["the engine process sends its report"],
        ms["its report reaches the worker's event loop"],
        ms["the worker has its events, the commit script is called"],
        ms["its events are in Redis (commit script returns)"],
    ]
    assert way_in == sorted(way_in) and engine_side == sorted(engine_side)
    assert ms["the worker starts on the piece"] <= ms["the engine process has it"]
    # The SDK reads the first event only once the commit that writes it has been called.
    commit_called = ms["the worker has its events, the commit script is called"]
    assert commit_called <= ms["the SDK reads the median job's first event"]
    assert commit_called <= ms["the median job's stream() yields it"]
    # --offer-before-start (the default): the first part went out once the worker started
    # on the piece, and the engine prepared the piece before it added it, and built ahead
    # (the echo engine builds nothing, but the loop gives it the chance) when it was idle.
    offered = ms["offered: the worker sends the first part"]
    prepared = ms["offered: the engine has prepared the last part"]
    added = ms["the engine has added it"]
    assert ms["the worker starts on the piece"] <= offered <= prepared <= added
    if built_ahead is not None:  # after some part was offered; later parts may come after
        assert offered <= built_ahead <= added


def test_group_medians_are_per_slice_of_jobs_in_submit_order() -> None:
    # The worker's default budget holds 32 prompts of 256 tokens: one full group 1 ms
    # apart from t0 + 0 ms, then a group of two.
    group = path_trace.slice_jobs(8192, 256, jobs=34)
    assert group == 32
    first = [1.0 + i / 1000 for i in range(group)] + [2.0, 2.002]
    assert path_trace.group_medians(first, 1.0, group) == [15.5, 1001.0]
    assert path_trace.slice_jobs(0, 256, jobs=34) == 34  # no budget: one slice

"""EarlyStarts: jobs started before the start script's verdict; the refused ones stopped and
their output dropped up to their end; output of waiting jobs held back until the verdict."""

from __future__ import annotations

import asyncio

import pytest

from exlq.worker.early_starts import EarlyStarts
from exlq.worker.engine_loop import StepReport
from exlq.worker.engines.base import CacheUsage, JobEnded, JobErrored, TokenChunk


class CancelRecorder:
    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)


def _report(*outputs: TokenChunk | JobEnded | JobErrored) -> StepReport:
    return StepReport(list(outputs), None, len(outputs), CacheUsage(0, 1))


def test_the_refused_are_stopped_and_their_output_dropped_up_to_their_end() -> None:
    early, engine = EarlyStarts(), CancelRecorder()
    early.begin(["runs", "refused", "also refused"], now=100.0)
    assert early.started_at("runs", now=101.0) == 100.0
    assert early.started_at("never early", now=101.0) == 101.0
    assert sorted(early.settle({"runs"}, engine)) == ["also refused", "refused"]  # type: ignore[arg-type]
    assert sorted(engine.cancelled) == ["also refused", "refused"]
    assert early.started_at("runs", now=102.0) == 102.0  # the verdict is in
    # The refused job's tokens and its end are dropped; the held one's pass.
    assert early.drops(TokenChunk("refused", "a", [1]))
    assert not early.drops(TokenChunk("runs", "a", [1]))
    assert early.drops(JobEnded("refused", "cancelled", 3, 1))
    # After its end, output under that id is a later start's.
    assert not early.drops(TokenChunk("refused", "b", [2]))
    assert early.drops(JobErrored("also refused", "internal_error", "x"))
    assert not early.drops(JobEnded("also refused", "length", 3, 2))


def test_without_a_verdict_every_early_start_is_stopped() -> None:
    early, engine = EarlyStarts(), CancelRecorder()
    early.begin(["a", "b"], now=1.0)
    early.abandon(engine)  # type: ignore[arg-type]
    assert sorted(engine.cancelled) == ["a", "b"]
    assert early.drops(TokenChunk("a", "x", [1])) and early.drops(TokenChunk("b", "x", [1]))
    assert not early.waiting


async def test_output_of_a_waiting_job_waits_for_the_verdict_and_others_do_not() -> None:
    early, engine = EarlyStarts(), CancelRecorder()
    early.begin(["waiting"], now=1.0)
    # Output of other jobs goes at once.
    await asyncio.wait_for(early.verdicts_for([_report(TokenChunk("held", "x", [1]))]), 1)
    blocked = asyncio.create_task(early.verdicts_for([_report(TokenChunk("waiting", "x", [1]))]))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    early.settle({"waiting"}, engine)  # type: ignore[arg-type]
    await asyncio.wait_for(blocked, 1)
    assert engine.cancelled == []


def test_a_second_piece_cannot_begin_before_the_first_is_settled() -> None:
    early, engine = EarlyStarts(), CancelRecorder()
    early.begin(["first"], now=1.0)
    with pytest.raises(RuntimeError, match="another's wait"):
        early.begin(["second"], now=2.0)
    early.settle({"first"}, engine)  # type: ignore[arg-type]
    early.begin(["second"], now=3.0)
    assert early.waiting == {"second"} and engine.cancelled == []

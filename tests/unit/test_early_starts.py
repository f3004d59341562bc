"""Jobs started before the start script's verdict (job_state.Piece, JobBook): the refused
ones stopped and their output dropped up to their end; output of waiting jobs held back
until the verdict."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest
from exlq.worker.engine_loop import StepReport
from exlq.worker.engines.base import CacheUsage, JobEnded, JobErrored, TokenChunk
from exlq.worker.job_state import JobBook, Piece, Stage
from exlq.worker.running_job import RunningJob


class CancelRecorder:
    """An engine runner that records the cancels (and takes offers and admits)."""

    def __init__(self) -> None:
        self.cancelled: list[str] = []

    def cancel(self, job_id: str) -> None:
        self.cancelled.append(job_id)

    def offer(self, round_id: int, jobs: Any) -> None:
        pass

    def admit(self, round_id: int, jobs: Any) -> None:
        pass


def _report(*outputs: TokenChunk | JobEnded | JobErrored) -> StepReport:
    return StepReport(list(outputs), None, len(outputs), CacheUsage(0, 1))


def _job(job_id: str, deadline: float | None = None) -> RunningJob:
    # Built unchecked: these ids read as what they stand for.
    request = GenerationRequest.model_construct(id=job_id, prompt="p", deadline=deadline)
    return RunningJob(job_id, f"entry-{job_id}", request, f"out:{job_id}", enqueued_at=0.0)


def _book() -> tuple[JobBook, CancelRecorder]:
    engine = CancelRecorder()
    return JobBook(engine), engine  # type: ignore[arg-type]


def _begin(book: JobBook, job_ids: list[str], now: float) -> tuple[Piece, dict[str, RunningJob]]:
    """A piece of these jobs, started early at ``now``."""
    piece = book.piece()
    jobs = {job_id: _job(job_id) for job_id in job_ids}
    for job in jobs.values():
        piece.take(job)
    piece.start_early(now)
    return piece, jobs


def _settle(piece: Piece, runs: set[str], now: float) -> None:
    """The verdict: the jobs in ``runs`` run, the others were ended already."""
    for job in piece.jobs:
        piece.judged(job, 1, now)
        if job.job_id in runs:
            piece.run(job)
        else:
            piece.settle(job, Stage.SKIPPED)
    piece.hand_over()


def test_the_refused_are_stopped_and_their_output_dropped_up_to_their_end() -> None:
    book, engine = _book()
    piece, jobs = _begin(book, ["runs", "refused", "also refused"], now=100.0)
    late = _job("never early", deadline=50.0)  # past its deadline: not started early
    piece.take(late)
    piece.judged(jobs["runs"], 1, now=101.0)
    piece.judged(late, 1, now=101.0)
    assert jobs["runs"].started_at == 100.0
    assert late.started_at == 101.0
    _settle(piece, {"runs"}, now=101.0)
    assert sorted(engine.cancelled) == ["also refused", "refused"]
    # The verdict is in: a later piece's job of that id starts at its own time.
    book.commit(_ended(book, jobs["runs"]))
    again, _ = _begin(book, ["runs"], now=102.0)
    assert again.jobs[0].started_at == 102.0
    # The refused job's tokens and its end are dropped; the held one's pass.
    assert book.drops(TokenChunk("refused", "a", [1]))
    assert not book.drops(TokenChunk("runs", "a", [1]))
    assert book.drops(JobEnded("refused", "cancelled", 3, 1))
    # After its end, output under that id is a later start's.
    assert not book.drops(TokenChunk("refused", "b", [2]))
    assert book.drops(JobErrored("also refused", "internal_error", "x"))
    assert not book.drops(JobEnded("also refused", "length", 3, 2))


def _ended(book: JobBook, job: RunningJob) -> RunningJob:
    book.end(job)
    return job


def test_without_a_verdict_every_early_start_is_stopped() -> None:
    book, engine = _book()
    piece, _ = _begin(book, ["a", "b"], now=1.0)
    piece.withdraw()
    assert sorted(engine.cancelled) == ["a", "b"]
    assert book.drops(TokenChunk("a", "x", [1])) and book.drops(TokenChunk("b", "x", [1]))
    assert not book.awaiting_verdict


async def test_output_of_a_waiting_job_waits_for_the_verdict_and_others_do_not() -> None:
    book, engine = _book()
    piece, _ = _begin(book, ["waiting"], now=1.0)
    # Output of other jobs goes at once.
    await asyncio.wait_for(book.verdicts_for([_report(TokenChunk("held", "x", [1]))]), 1)
    blocked = asyncio.create_task(book.verdicts_for([_report(TokenChunk("waiting", "x", [1]))]))
    await asyncio.sleep(0.01)
    assert not blocked.done()
    _settle(piece, {"waiting"}, now=2.0)
    await asyncio.wait_for(blocked, 1)
    assert engine.cancelled == []


def test_a_second_piece_cannot_begin_before_the_first_is_settled() -> None:
    book, engine = _book()
    first, _ = _begin(book, ["first"], now=1.0)
    with pytest.raises(RuntimeError, match="another's wait"):
        book.piece()
    _settle(first, {"first"}, now=2.0)
    _begin(book, ["second"], now=3.0)
    assert [job.job_id for job in book.jobs_in(frozenset({Stage.STARTED}))] == ["second"]
    assert engine.cancelled == []

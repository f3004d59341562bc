"""The state machine of a job in the worker (worker/job_state.py): every legal move, every
illegal one refused; and JobBook, which holds the jobs and keeps the slots they use."""

from __future__ import annotations

import itertools
import time
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exlq.protocol.models import GenerationRequest
from exlq.worker.job_state import (
    HELD,
    NEXT,
    PUBLISHING,
    IllegalTransition,
    JobBook,
    Piece,
    Stage,
    move,
)
from exlq.worker.running_job import RunningJob

LEGAL = [(stage, to) for stage, moves in NEXT.items() for to in sorted(moves)]
ILLEGAL = [(s, t) for s, t in itertools.product(Stage, Stage) if t not in NEXT[s]]
TERMINAL = {Stage.SKIPPED, Stage.FAILED, Stage.CANCELLED, Stage.WITHDRAWN, Stage.COMMITTED}


class Runner:
    """An engine runner recording what the book asks of it."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def offer(self, round_id: int, jobs: list[tuple[str, Any]]) -> None:
        self.calls.append(("offer", round_id, [job_id for job_id, _ in jobs]))

    def admit(self, round_id: int, jobs: list[tuple[str, Any]]) -> None:
        self.calls.append(("admit", round_id, [job_id for job_id, _ in jobs]))

    def cancel(self, job_id: str) -> None:
        self.calls.append(("cancel", job_id))


def _job(job_id: str, stage: Stage = Stage.PARSED, entry: str | None = None) -> RunningJob:
    request = GenerationRequest(id=job_id, prompt="p")
    job = RunningJob(job_id, entry or f"{job_id}-0", request, "out", enqueued_at=0.0)
    job.stage = stage
    return job


def _book() -> tuple[JobBook, Runner]:
    runner = Runner()
    return JobBook(runner), runner  # type: ignore[arg-type]


@pytest.mark.parametrize(("stage", "to"), LEGAL, ids=[f"{s.name}->{t.name}" for s, t in LEGAL])
def test_every_legal_move(stage: Stage, to: Stage) -> None:
    job = _job("a", stage)
    move(job, to)
    assert job.stage is to


@pytest.mark.parametrize(("stage", "to"), ILLEGAL, ids=[f"{s.name}->{t.name}" for s, t in ILLEGAL])
def test_every_illegal_move_raises_and_leaves_the_job_where_it_was(stage: Stage, to: Stage) -> None:
    job = _job("a", stage)
    with pytest.raises(IllegalTransition, match=f"job a: no move from {stage.name} to {to.name}"):
        move(job, to)
    assert job.stage is stage


def test_the_machine_is_whole() -> None:
    assert set(NEXT) == set(Stage)
    # Terminal stages have no way out; every other one reaches one.
    assert {stage for stage, moves in NEXT.items() if not moves} == TERMINAL
    reached, frontier = {Stage.PARSED}, [Stage.PARSED]
    while frontier:
        for to in NEXT[frontier.pop()] - reached:
            reached.add(to)
            frontier.append(to)
    assert reached == set(Stage)  # every stage is reachable from a parse
    assert PUBLISHING < HELD and not HELD & TERMINAL


def test_a_job_lives_through_the_book_from_parse_to_commit() -> None:
    book, runner = _book()
    piece = book.piece()
    job = _job("a")
    piece.take(job)
    assert job.stage is Stage.OFFERED and book.get("a") is job and book.held == 0
    piece.start_early(now=10.0)
    assert job.stage is Stage.STARTED and job.started_at == 10.0 and book.awaiting_verdict
    piece.judged(job, attempt=2, now=11.0)
    piece.run(job)
    piece.hand_over()
    assert job.stage is Stage.RUNNING and job.attempt == 2 and job.started_at == 10.0
    assert book.held == 1 and not book.awaiting_verdict
    assert book.stop("a", "expired") and job.stop_reason == "expired"
    assert not book.stop("a")  # stopping already: one cancel
    book.end(job)
    book.commit(job)
    assert job.stage is Stage.COMMITTED and book.get("a") is None and book.held == 0
    assert book.peak_held == 1
    assert runner.calls == [
        ("offer", 0, ["a"]),
        ("admit", 0, ["a"]),
        ("cancel", "a"),
    ]


def test_the_book_refuses_what_a_job_cannot_do() -> None:
    book, _ = _book()
    piece = book.piece()
    job = _job("a")
    piece.take(job)
    with pytest.raises(IllegalTransition):
        book.commit(job)  # not ended: its slot is not free to give
    with pytest.raises(IllegalTransition):
        book.end(job)  # the engine does not run it
    piece.start_early(now=1.0)
    piece.run(job)
    book.end(job)
    with pytest.raises(IllegalTransition):
        book.end(job)  # one end per start
    with pytest.raises(IllegalTransition):
        piece.settle(job, Stage.SKIPPED)  # the verdict was taken


def test_a_job_under_an_id_held_here_stays_out_of_the_book_and_is_settled() -> None:
    book, runner = _book()
    piece = book.piece()
    first, second = _job("a", entry="e1"), _job("a", entry="e2")
    piece.take(first)
    piece.take(second)
    assert piece.held_elsewhere(second) and not piece.held_elsewhere(first)
    piece.start_early(now=1.0)
    piece.run(first)
    with pytest.raises(IllegalTransition):
        piece.run(second)  # never offered: it cannot run
    piece.settle(second, Stage.SKIPPED)
    piece.hand_over()
    assert book.get("a") is first and book.held == 1  # the other job keeps its place
    assert ("cancel", "a") not in runner.calls


def test_lost_jobs_write_nothing_and_are_stopped_once() -> None:
    book, runner = _book()
    piece = book.piece()
    jobs = [_job(name) for name in ("running", "stopping", "kept")]
    for job in jobs:
        piece.take(job)
    piece.start_early(now=1.0)
    for job in jobs:
        piece.run(job)
    piece.hand_over()
    book.stop("stopping")
    lost = book.lose(["running-0", "stopping-0", "elsewhere"])
    assert [job.job_id for job in lost] == ["running", "stopping"]
    assert [job.stage for job in jobs] == [Stage.LOST, Stage.LOST, Stage.RUNNING]
    assert runner.calls[-2:] == [("cancel", "stopping"), ("cancel", "running")]
    assert book.lose(["running-0"]) == []  # lost already
    assert not book.stop("running")


def test_a_withdrawn_piece_leaves_its_entries_and_stops_its_early_starts() -> None:
    book, runner = _book()
    piece = book.piece()
    late = _job("late")
    late.request = GenerationRequest(id="late", prompt="p", deadline=time.time() - 1)
    jobs = [_job("early"), late]
    for job in jobs:
        piece.take(job)
    piece.start_early(time.time())
    piece.withdraw()
    assert [job.stage for job in jobs] == [Stage.WITHDRAWN, Stage.WITHDRAWN]
    assert book.get("early") is None and book.held == 0 and not book.awaiting_verdict
    assert runner.calls[-1] == ("cancel", "early")  # started early: stopped
    assert book.dropping == {"early": 1}


# A piece's verdict, job by job: run, or settle in one of the stages a verdict ends in.
verdicts = st.lists(
    st.sampled_from([Stage.RUNNING, Stage.SKIPPED, Stage.FAILED, Stage.CANCELLED, Stage.WITHDRAWN]),
    min_size=1,
    max_size=12,
)


@settings(max_examples=200, deadline=None, database=None)
@given(st.lists(verdicts, min_size=1, max_size=5), st.data())
def test_the_slots_held_are_the_jobs_in_held_stages(pieces: list[list[Stage]], data: Any) -> None:
    """Pieces of jobs (some ids repeated), each started early and judged; then each running
    job stops, ends or is lost in turn. The slot count is always the held jobs', every
    early start the verdict refused is stopped, and every job leaves the book in the end."""
    book, runner = _book()
    running: list[RunningJob] = []
    for n, stages in enumerate(pieces):
        piece = book.piece()
        ids = [f"j{data.draw(st.integers(0, 6))}" for _ in stages]
        jobs = [_job(job_id, entry=f"{n}-{i}") for i, job_id in enumerate(ids)]
        for job in jobs:
            piece.take(job)
        piece.start_early(now=1.0)
        stopped = _judge(piece, jobs, stages, running)
        calls = len(runner.calls)
        piece.hand_over()
        assert [c for c in runner.calls[calls:] if c[0] == "cancel"] == [
            ("cancel", job_id) for job_id in stopped
        ]
        assert book.held == len(book.jobs_in(HELD)) == len(running)
        assert not book.awaiting_verdict
        for job in list(running):
            _act(book, job, data.draw(st.sampled_from(["stop", "lose", "end", "keep"])), running)
            assert book.held == len(running)
    for job in list(running):
        _act(book, job, "end", running)
    assert book.held == 0 and book.jobs_in(frozenset(Stage)) == []


def _judge(
    piece: Piece, jobs: list[RunningJob], stages: list[Stage], running: list[RunningJob]
) -> list[str]:
    """The verdict on each job; returns the ids it refused after an early start."""
    stopped = []
    for job, to in zip(jobs, stages, strict=True):
        if to is Stage.RUNNING and not piece.held_elsewhere(job):
            piece.run(job)
            running.append(job)
            continue
        if job.stage is Stage.STARTED:
            stopped.append(job.job_id)
        piece.settle(job, Stage.SKIPPED if to is Stage.RUNNING else to)
    return stopped


def _act(book: JobBook, job: RunningJob, action: str, running: list[RunningJob]) -> None:
    if action == "stop":
        book.stop(job.job_id)
    elif action == "lose":
        book.lose([job.entry_id])
    elif action == "end":
        book.end(job)
        book.commit(job)
        running.remove(job)


def test_every_piece_gets_a_round_of_its_own() -> None:
    book, runner = _book()
    for name in ("a", "b"):
        piece: Piece = book.piece()
        piece.take(_job(name))
        piece.start_early(now=1.0)
        piece.settle(piece.jobs[0], Stage.CANCELLED)
        piece.hand_over()
    assert [call[1] for call in runner.calls if call[0] == "admit"] == [0, 1]

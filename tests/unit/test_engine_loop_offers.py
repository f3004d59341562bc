"""Offers in the engine loop: offered jobs are readied, never run, until the round's admit
names them; the admit drops the rest. And the worker's side: job_state.Piece and
OfferRound."""

from __future__ import annotations

import queue
import time
from collections.abc import Callable
from typing import Any

from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.engine_loop import EngineLoop, StepReport
from exlq.worker.engines.base import EngineOutput, JobEnded, JobErrored, PreparesJobs
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.job_state import JobBook, Piece
from exlq.worker.offer_round import OFFER_PART, OfferRound
from exlq.worker.running_job import RunningJob
from tests.engine_reports import collect_ends


class OfferEngine(EchoEngine, PreparesJobs):
    """Echo that logs its intake; prepare() refuses prompts saying 'refuse'."""

    def __init__(self) -> None:
        super().__init__(capacity=8, tokens_per_second=2000)
        self.log: list[tuple[str, Any]] = []
        self.steps: list[list[str]] = []

    def prepare(self, job_id: str, request: GenerationRequest) -> object:
        self.log.append(("prepare", job_id))
        if request.prompt == "refuse":
            raise InvalidRequest("prompt too long for this model")
        return ("ready", job_id, request)

    def admit(self, job_id: str, prepared: object) -> None:
        assert isinstance(prepared, tuple) and prepared[1] == job_id
        self.log.append(("admit", job_id))
        super().add(job_id, prepared[2])

    def build_ahead(self, prepared: list[object]) -> None:
        self.log.append(("build_ahead", [p[1] for p in prepared]))  # type: ignore[index]

    def step(self) -> list[EngineOutput]:
        self.steps.append(sorted(self._jobs))
        return super().step()


def _request(prompt: str, max_new_tokens: int = 2) -> GenerationRequest:
    return GenerationRequest(prompt=prompt, max_new_tokens=max_new_tokens)


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 5
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.001)


def _started(engine: OfferEngine) -> tuple[OfferEngine, EngineLoop, queue.SimpleQueue[StepReport]]:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(engine)
    loop.start(reports.put)
    return engine, loop, reports


def test_an_engine_that_prepares_nothing_gets_offered_jobs_whole_at_their_admit() -> None:
    # The echo engine declares no PreparesJobs: an offer only holds the request, and the
    # admit adds it; a job the admit does not name never reaches the engine.
    engine = EchoEngine(capacity=4, tokens_per_second=2000)
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(engine)
    loop.start(reports.put)
    loop.offer(1, [("a", _request("one")), ("b", _request("two"))])
    loop.admit(1, [("a", None)])
    ended = collect_ends(reports, 1)
    loop.stop(5)
    assert [(e.job_id, e.finish_reason) for e in ended if isinstance(e, JobEnded)] == [
        ("a", "length")
    ]
    assert engine.active_jobs == 0


def test_offered_jobs_wait_for_the_admit_which_starts_the_named_ones_together() -> None:
    engine, loop, reports = _started(OfferEngine())
    loop.offer(1, [("a", _request("one")), ("b", _request("two"))])
    loop.offer(1, [("c", _request("three"))])
    _wait_for(lambda: ("build_ahead", ["a", "b", "c"]) in engine.log)
    # Readied in order, built ahead while idle, and none run: no step, no report.
    assert [e for e in engine.log if e[0] == "prepare"] == [("prepare", j) for j in "abc"]
    assert engine.steps == [] and reports.empty()

    # The start script refused b: the admit names a and c, by id alone.
    loop.admit(1, [("a", None), ("c", None)])
    ended = collect_ends(reports, 2)
    loop.stop(5)
    assert sorted(e.job_id for e in ended) == ["a", "c"]
    assert all(isinstance(e, JobEnded) and e.finish_reason == "length" for e in ended)
    assert [e for e in engine.log if e[0] == "admit"] == [("admit", "a"), ("admit", "c")]
    assert engine.steps[0] == ["a", "c"]  # one pass started both
    # Once jobs run, the loop builds nothing ahead (the round is gone, too).
    last_build_ahead = max(i for i, e in enumerate(engine.log) if e[0] == "build_ahead")
    assert last_build_ahead < engine.log.index(("admit", "a"))


def test_a_refused_offer_fails_only_if_the_job_is_admitted() -> None:
    engine, loop, reports = _started(OfferEngine())
    loop.offer(1, [("bad", _request("refuse")), ("ok", _request("fine"))])
    loop.offer(2, [("bad-but-skipped", _request("refuse"))])
    loop.admit(2, [])  # the start script refused it: nothing to say about it
    loop.admit(1, [("bad", None), ("ok", None)])
    first = reports.get(timeout=5)
    ended = [o for o in first.outputs if not hasattr(o, "text")]
    # The admitted job that failed its check fails in the admit's pass, as an add would.
    assert ended[0] == JobErrored("bad", "invalid_request", "prompt too long for this model")
    ended += collect_ends(reports, 2 - len(ended))
    loop.stop(5)
    assert [e.job_id for e in ended] == ["bad", "ok"]
    assert ("admit", "bad") not in engine.log


def test_rounds_stay_apart_and_an_admit_may_bring_jobs_whole() -> None:
    engine, loop, reports = _started(OfferEngine())
    loop.offer(1, [("first", _request("one"))])
    loop.offer(2, [("second", _request("two"))])
    # Round 2 ends first; it also starts a job it never offered, given whole.
    loop.admit(2, [("second", None), ("whole", _request("three"))])
    loop.admit(1, [])  # round 1's start script failed: its offer is dropped
    loop.admit(3, [("ghost", None)])  # named, never offered: the worker's bug
    ended = collect_ends(reports, 3)
    loop.stop(5)
    assert sorted(e.job_id for e in ended) == ["ghost", "second", "whole"]
    ghost = next(e for e in ended if e.job_id == "ghost")
    assert isinstance(ghost, JobErrored) and ghost.code == "internal_error"
    assert ("admit", "first") not in engine.log
    assert engine.steps[0] == ["second", "whole"]


def test_offers_made_while_jobs_run_are_readied_but_not_built_ahead() -> None:
    engine, loop, reports = _started(OfferEngine())
    loop.offer(1, [("long", _request("one", max_new_tokens=400))])
    loop.admit(1, [("long", None)])
    _wait_for(lambda: len(engine.steps) >= 2)
    loop.offer(2, [("late", _request("two"))])
    _wait_for(lambda: ("prepare", "late") in engine.log)
    time.sleep(0.02)  # a few more steps
    assert not any(e[0] == "build_ahead" and "late" in e[1] for e in engine.log)
    loop.admit(2, [("late", None)])
    ended = collect_ends(reports, 2)
    loop.stop(5)
    assert sorted(e.job_id for e in ended) == ["late", "long"]


class RecordingRunner:
    """The worker's side of an engine runner, recording what it is handed."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, ...]] = []

    def offer(self, round_id: int, jobs: list[tuple[str, GenerationRequest]]) -> None:
        self.calls.append(("offer", round_id, [job_id for job_id, _ in jobs]))

    def admit(self, round_id: int, jobs: list[tuple[str, GenerationRequest | None]]) -> None:
        self.calls.append(("admit", round_id, jobs))

    def add_many(self, jobs: list[tuple[str, GenerationRequest]]) -> None:
        self.calls.append(("add", jobs))


def _requests(n: int) -> list[GenerationRequest]:
    return [GenerationRequest(id=f"j{i}", prompt=f"p{i}") for i in range(n)]


def _job(request: GenerationRequest) -> RunningJob:
    return RunningJob(request.id, f"entry-{request.id}", request, "out", enqueued_at=0.0)


def _piece(runner: RecordingRunner, round_id: int) -> Piece:
    return Piece(JobBook(runner), OfferRound(runner, round_id))  # type: ignore[arg-type]


def test_an_offer_round_sends_parts_as_they_fill_and_names_offered_jobs_by_id() -> None:
    runner = RecordingRunner()
    requests = _requests(1 + OFFER_PART + OFFER_PART + 3)
    piece = _piece(runner, 7)
    for request in requests:
        piece.take(_job(request))
    # Each part went as it filled: the first job alone, then OFFER_PART at a time; the
    # rest waits for flush() (or the admit).
    sizes = [len(call[2]) for call in runner.calls]
    assert sizes == [1, OFFER_PART, OFFER_PART]
    assert [job_id for call in runner.calls for job_id in call[2]] == [
        r.id for r in requests[: sum(sizes)]
    ]
    # Another request under a used id is not offered: the id stands for one request.
    other = _job(GenerationRequest(id="j0", prompt="another request under a used id"))
    piece.take(other)
    piece.flush()
    assert runner.calls[3] == ("offer", 7, [r.id for r in requests[sum(sizes) :]])
    assert piece.start_early(time.time()) == [r.id for r in requests]
    # Offered: by id; the job under a used id is the verdict's to settle, never started.
    assert runner.calls[4] == ("admit", 7, [(r.id, None) for r in requests])
    assert piece.held_elsewhere(other)
    assert len(runner.calls) == 5


def test_a_round_admit_may_bring_jobs_whole() -> None:
    runner = RecordingRunner()
    offers = OfferRound(runner, 7)  # type: ignore[arg-type]
    offered, whole = _requests(2)
    offers.offer("j0", offered)
    offers.start(["j0"])
    offers.start_whole([("j1", whole)])
    assert runner.calls == [
        ("offer", 7, ["j0"]),
        ("admit", 7, [("j0", None)]),
        ("admit", 7, [("j1", whole)]),
    ]


def test_a_withdrawn_round_drops_its_offers() -> None:
    runner = RecordingRunner()
    unsent = OfferRound(runner, 1)  # type: ignore[arg-type]
    unsent.withdraw()
    assert runner.calls == []  # nothing went: the engine has nothing to drop
    withdrawn = OfferRound(runner, 2)  # type: ignore[arg-type]
    for request in _requests(2):
        withdrawn.offer(request.id, request)  # j0 goes at once, j1 waits for a full part
    withdrawn.withdraw()
    assert runner.calls == [("offer", 2, ["j0"]), ("admit", 2, [])]  # j1 never goes


def test_an_early_admit_starts_the_offered_jobs_and_the_later_admit_brings_only_the_rest() -> None:
    runner = RecordingRunner()
    piece = _piece(runner, 4)
    now = time.time()
    live, expired, later = (
        _job(GenerationRequest(id="live", prompt="p")),
        _job(GenerationRequest(id="expired", prompt="p", deadline=now - 1)),
        _job(GenerationRequest(id="later", prompt="p", deadline=now + 60)),
    )
    for job in (live, expired, later):
        piece.take(job)
    # The parts go out, then one admit names every offered job but the expired one (the
    # start script ends it), before any verdict.
    assert piece.start_early(now) == ["live", "later"]
    assert runner.calls == [
        ("offer", 4, ["live"]),
        ("offer", 4, ["expired", "later"]),
        ("admit", 4, [("live", None), ("later", None)]),
    ]
    # The verdict's admit: what started early is not started again; a job started only
    # now goes whole (the round's offers are used up): here the expired one, whose
    # deadline the verdict's clock put back in the future.
    for job in (live, later, expired):
        piece.run(job)
    piece.hand_over()
    assert runner.calls[3:] == [("admit", 4, [("expired", expired.request)])]
    piece.hand_over()
    piece.withdraw()
    assert len(runner.calls) == 4  # nothing more: the round is over in the engine

"""The engine thread: a failing job or step fails its jobs, never the worker."""

from __future__ import annotations

import queue
import threading

from producer.protocol import GenerationRequest, InvalidRequest
from worker.engine_loop import EngineLoop, StepReport
from worker.engines.base import CacheUsage, EngineDead, EngineOutput, JobEnded, JobErrored
from worker.engines.echo import EchoEngine


class FlakyEngine(EchoEngine):
    """Echo, but refuses prompts saying 'refuse', and its step fails once on 'explode'."""

    def __init__(self) -> None:
        super().__init__(capacity=4, tokens_per_second=1000)
        self.exploded = False

    def add(self, job_id: str, request: GenerationRequest) -> None:
        if request.prompt == "refuse":
            raise InvalidRequest("prompt too long for this model")
        super().add(job_id, request)

    def step(self) -> list[EngineOutput]:
        if not self.exploded and any(j.request.prompt == "explode" for j in self._jobs.values()):
            self.exploded = True
            raise RuntimeError("kernel fault")
        return super().step()


def _collect(
    loop: EngineLoop, reports: queue.SimpleQueue[StepReport], want: int
) -> list[EngineOutput]:
    ended: list[EngineOutput] = []
    while len(ended) < want:
        report = reports.get(timeout=5)
        assert report.fatal is None
        ended += [o for o in report.outputs if not hasattr(o, "text")]
    return ended


def test_refused_and_failed_jobs_error_while_others_finish() -> None:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(FlakyEngine())
    loop.start(reports.put)
    loop.add_many([("a", GenerationRequest(prompt="refuse", max_new_tokens=3))])
    ended = _collect(loop, reports, 1)
    assert ended == [JobErrored("a", "invalid_request", "prompt too long for this model")]

    loop.add_many([("b", GenerationRequest(prompt="explode", max_new_tokens=3))])
    ended = _collect(loop, reports, 1)
    assert ended == [JobErrored("b", "engine_error", "RuntimeError: kernel fault")]

    loop.add_many([("c", GenerationRequest(prompt="fine", max_new_tokens=3))])
    ended = _collect(loop, reports, 1)
    assert ended == [JobEnded("c", "length", 1, 3)]
    loop.stop(5)


def test_cancel_ends_a_job_at_once() -> None:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(EchoEngine(2, 50))
    loop.start(reports.put)
    loop.add_many([("long", GenerationRequest(prompt="x", max_new_tokens=10_000))])
    reports.get(timeout=5)
    loop.cancel("long")
    ended = _collect(loop, reports, 1)
    assert isinstance(ended[0], JobEnded) and ended[0].finish_reason == "cancelled"
    loop.stop(5)
    assert loop.engine.active_jobs == 0


class DeadEngine(EchoEngine):
    def step(self) -> list[EngineOutput]:
        raise RuntimeError("CUDA error: an illegal memory access was encountered")

    def abort_all(self) -> list[str]:
        raise EngineDead("CUDA context is lost")


def test_dead_engine_is_reported_as_fatal() -> None:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    done = threading.Event()
    loop = EngineLoop(DeadEngine(1, 100))
    loop.start(lambda r: (reports.put(r), done.set()))
    loop.add_many([("x", GenerationRequest(prompt="x", max_new_tokens=3))])
    report = reports.get(timeout=5)
    assert report.fatal == "CUDA context is lost"
    assert report.cache == CacheUsage(0, 0)


class CountingEngine(FlakyEngine):
    """FlakyEngine that records how many jobs each step ran."""

    def __init__(self) -> None:
        super().__init__()
        self.jobs_per_step: list[int] = []

    def step(self) -> list[EngineOutput]:
        self.jobs_per_step.append(self.active_jobs)
        return super().step()


def test_jobs_handed_over_together_start_in_the_same_step() -> None:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    engine = CountingEngine()
    loop = EngineLoop(engine)
    loop.start(reports.put)
    loop.add_many(
        [(f"j{i}", GenerationRequest(prompt="a b", max_new_tokens=2)) for i in range(12)]
        + [("bad", GenerationRequest(prompt="refuse", max_new_tokens=2))]
    )
    ended = _collect(loop, reports, 13)
    loop.stop(5)
    # The whole hand-over was admitted before the first step; the refused job errored alone.
    assert engine.jobs_per_step[0] == 12
    assert sum(isinstance(e, JobEnded) for e in ended) == 12
    assert [e.job_id for e in ended if isinstance(e, JobErrored)] == ["bad"]

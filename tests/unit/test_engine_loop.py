"""The engine thread: a failing job or step fails its jobs, never the worker."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable

from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.engine_loop import EngineLoop, StepReport
from exlq.worker.engines.base import (
    CacheUsage,
    EngineDead,
    EngineOutput,
    JobEnded,
    JobErrored,
    TokenChunk,
)
from exlq.worker.engines.echo.engine import EchoEngine
from tests.engine_reports import collect_ends


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


def test_refused_and_failed_jobs_error_while_others_finish() -> None:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(FlakyEngine())
    loop.start(reports.put)
    loop.add_many([("a", GenerationRequest(prompt="refuse", max_new_tokens=3))])
    ended = collect_ends(reports, 1)
    assert ended == [JobErrored("a", "invalid_request", "prompt too long for this model")]

    loop.add_many([("b", GenerationRequest(prompt="explode", max_new_tokens=3))])
    ended = collect_ends(reports, 1)
    assert ended == [JobErrored("b", "engine_error", "RuntimeError: kernel fault")]

    loop.add_many([("c", GenerationRequest(prompt="fine", max_new_tokens=3))])
    ended = collect_ends(reports, 1)
    assert ended == [JobEnded("c", "length", 1, 3)]
    loop.stop(5)


def test_cancel_ends_a_job_at_once() -> None:
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(EchoEngine(2, 50))
    loop.start(reports.put)
    loop.add_many([("long", GenerationRequest(prompt="x", max_new_tokens=10_000))])
    reports.get(timeout=5)
    loop.cancel("long")
    ended = collect_ends(reports, 1)
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
    ended = collect_ends(reports, 13)
    loop.stop(5)
    # The whole hand-over was admitted before the first step; the refused job errored alone.
    assert engine.jobs_per_step[0] == 12
    assert sum(isinstance(e, JobEnded) for e in ended) == 12
    assert [e.job_id for e in ended if isinstance(e, JobErrored)] == ["bad"]


class ScriptedEngine(EchoEngine):
    """Echo whose steps log when they begin, wait for their "device" and end; the steps
    numbered in ``waits`` run the loop's wait work between their first half and second.
    ``arrivals[n]`` runs in step n before its wait (commands that arrive while the GPU
    works). Adds and cancels are logged; a prompt of "refuse" is refused."""

    def __init__(
        self,
        log: list[str],
        waits: set[int],
        arrivals: dict[int, Callable[[], None]] | None = None,
    ) -> None:
        super().__init__(capacity=4, tokens_per_second=1000)
        self.log = log
        self.waits = waits
        self.arrivals = arrivals or {}
        self.steps = 0

    def add(self, job_id: str, request: GenerationRequest) -> None:
        self.log.append(f"add {job_id}")
        if request.prompt == "refuse":
            raise InvalidRequest("refused")
        super().add(job_id, request)

    def cancel(self, job_id: str) -> JobEnded | None:
        self.log.append(f"cancel {job_id}")
        return super().cancel(job_id)

    def step(self) -> list[EngineOutput]:
        self.steps += 1
        self.log.append(f"step {self.steps}")
        if self.steps in self.arrivals:
            self.arrivals[self.steps]()
        if self.steps in self.waits and self.wait_work is not None:
            self.wait_work()
        outputs = super().step()
        self.log.append(f"end {self.steps}")
        return outputs

    def _pace(self) -> None:
        """No pause (nor wait work) of the echo engine's own."""


def _run_scripted(waits: set[int]) -> list[str]:
    log: list[str] = []
    done = threading.Event()

    def sink(report: StepReport) -> None:
        log.append("report " + " ".join(_describe(o) for o in report.outputs))
        if any(isinstance(o, JobEnded) for o in report.outputs):
            done.set()

    loop = EngineLoop(ScriptedEngine(log, waits))
    loop.start(sink)
    loop.add_many([("a", GenerationRequest(prompt="one two three four", max_new_tokens=4))])
    assert done.wait(5)
    loop.stop(5)
    return [line for line in log if not line.startswith("add ")]


def _describe(output: EngineOutput) -> str:
    if isinstance(output, TokenChunk):
        return output.text.strip()
    return type(output).__name__


EVERY_STEP = {1, 2, 3, 4}


def test_a_steps_tokens_go_out_in_the_next_steps_wait_for_the_gpu() -> None:
    log = _run_scripted(waits=EVERY_STEP)
    assert log == [
        "step 1",
        "end 1",
        "report one",  # a job's first text goes at once
        "step 2",
        "end 2",  # "two" is held ...
        "step 3",
        "report two",  # ... and sent while step 3 waits for the GPU
        "end 3",
        "step 4",
        "report three",
        "end 4",
        "report four JobEnded",  # the end goes at once
    ]


def test_held_tokens_go_out_after_a_step_that_does_not_wait_and_nothing_waits_on_it() -> None:
    log = _run_scripted(waits={2})
    assert log == [
        "step 1",
        "end 1",
        "report one",
        "step 2",
        "end 2",  # step 2 waited: "two" is held
        "step 3",
        "end 3",
        "report two",  # step 3 did not wait: "two" goes after it, before its own
        "report three",  # and step 3's own goes at once
        "step 4",
        "end 4",
        "report four JobEnded",
    ]


SEND_AS_EACH_STEP_ENDS = [
    "step 1",
    "end 1",
    "report one",
    "step 2",
    "end 2",
    "report two",
    "step 3",
    "end 3",
    "report three",
    "step 4",
    "end 4",
    "report four JobEnded",
]


def test_an_engine_that_never_waits_reports_each_step_as_it_ends() -> None:
    assert _run_scripted(waits=set()) == SEND_AS_EACH_STEP_ENDS


def test_a_sink_that_fails_in_the_wait_ends_the_loop_without_failing_the_jobs() -> None:
    reports: list[StepReport] = []
    fatal = threading.Event()
    calls = 0

    def sink(report: StepReport) -> None:
        nonlocal calls
        calls += 1
        if calls == 2:  # the first held report, sent inside step 3
            raise BrokenPipeError("the worker is gone")
        reports.append(report)
        if report.fatal is not None:
            fatal.set()

    loop = EngineLoop(ScriptedEngine([], waits=EVERY_STEP))
    loop.start(sink)
    loop.add_many([("a", GenerationRequest(prompt="one two three four", max_new_tokens=4))])
    assert fatal.wait(5)
    outputs = [o for r in reports for o in r.outputs]
    assert not any(isinstance(o, JobErrored) for o in outputs)
    assert "BrokenPipeError" in (reports[-1].fatal or "")


def _run_with_arrivals() -> tuple[list[str], list[EngineOutput]]:
    """Job a runs; while step 2 waits for the GPU, three commands arrive: add b (refused),
    cancel a, add c."""
    log: list[str] = []
    outputs: list[EngineOutput] = []
    done = threading.Event()

    def sink(report: StepReport) -> None:
        errors = [o.job_id for o in report.outputs if isinstance(o, JobErrored)]
        log.append(f"report {' '.join(errors)}".strip())
        outputs.extend(report.outputs)
        if any(isinstance(o, JobEnded) and o.job_id == "c" for o in report.outputs):
            done.set()

    def arrive() -> None:
        loop.add_many([("b", GenerationRequest(prompt="refuse", max_new_tokens=2))])
        loop.cancel("a")
        loop.add_many([("c", GenerationRequest(prompt="x", max_new_tokens=2))])

    engine = ScriptedEngine(log, waits=EVERY_STEP, arrivals={2: arrive})
    loop = EngineLoop(engine)
    loop.start(sink)
    loop.add_many([("a", GenerationRequest(prompt="one two three four", max_new_tokens=4))])
    assert done.wait(5)
    loop.stop(5)
    return log, outputs


def _without_reports(log: list[str]) -> list[str]:
    return [line for line in log if not line.startswith("report")]


def test_jobs_that_arrive_while_a_step_waits_are_added_in_the_wait_in_order() -> None:
    log, outputs = _run_with_arrivals()
    # b's refusal goes out with step 2's report, the first after the step.
    after_step_2 = log[log.index("end 2") :]
    assert next(line for line in after_step_2 if line.startswith("report")) == "report b"
    assert _without_reports(log)[:8] == [
        "add a",
        "step 1",
        "end 1",
        "step 2",
        "add b",  # in step 2's wait: the adds up to the first other command
        "end 2",
        "cancel a",  # a cancel never runs inside a step; it and what follows it wait
        "add c",
    ]
    assert JobErrored("b", "invalid_request", "refused") in outputs
    assert JobEnded("a", "cancelled", 4, 2) in outputs


class ReadyingEngine(ScriptedEngine):
    """ScriptedEngine whose readying of the next step ends job "late" (as a build that
    failed) the first time it runs, and counts its calls."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(log, waits=EVERY_STEP)
        self.readied = 0

    def prepare_next_step(self) -> list[EngineOutput]:
        self.readied += 1
        self.log.append(f"ready {self.steps}")
        if self.readied == 1:
            return [JobErrored("late", "engine_error", "RuntimeError: no pages")]
        return []


def _run_readying() -> tuple[ReadyingEngine, list[str], list[StepReport]]:
    log: list[str] = []
    reports: list[StepReport] = []
    done = threading.Event()

    def sink(report: StepReport) -> None:
        reports.append(report)
        if any(isinstance(o, JobEnded) for o in report.outputs):
            done.set()

    engine = ReadyingEngine(log)
    loop = EngineLoop(engine)
    loop.start(sink)
    loop.add_many([("a", GenerationRequest(prompt="one two", max_new_tokens=2))])
    assert done.wait(5)
    loop.stop(5)
    return engine, log, reports


def test_the_wait_readies_the_next_step_and_its_ends_go_with_the_step() -> None:
    _, log, reports = _run_readying()
    # Once in each step's wait, after the step began and before it ended.
    assert [line for line in log if not line.startswith("add ")] == [
        "step 1",
        "ready 1",
        "end 1",
        "step 2",
        "ready 2",
        "end 2",
    ]
    errors = [o for o in reports[0].outputs if isinstance(o, JobErrored)]
    assert errors == [JobErrored("late", "engine_error", "RuntimeError: no pages")]


def test_a_stopped_loop_leaves_no_wait_work_in_the_engine() -> None:
    engine = ReadyingEngine([])
    loop = EngineLoop(engine)
    loop.start(lambda report: None)
    loop.add_many([("a", GenerationRequest(prompt="one", max_new_tokens=1))])
    loop.stop(5)
    assert engine.wait_work is None

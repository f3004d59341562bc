"""EngineLoop: runs the engine on a thread of its own, so Redis I/O never waits on the GPU."""

from __future__ import annotations

import asyncio
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from typing import Generic, Protocol, TypeVar, cast

import msgspec

from exlq.protocol.models import InvalidRequest
from exlq.worker import tracing
from exlq.worker.engines.base import (
    CacheUsage,
    Engine,
    EngineDead,
    EngineOutput,
    JobErrored,
    PreparesJobs,
    TokenChunk,
    UsesDeviceWait,
    describe_error,
)
from exlq.worker.engines.engine_request import EngineRequest
from exlq.worker.gc_pauses import HeldCollections

log = logging.getLogger(__name__)

_T = TypeVar("_T")
# The form of the requests a command carries; covariant: a command is frozen, and one that
# carries PackedRequests is a command of EngineRequests.
_R = TypeVar("_R", covariant=True)

SLOW_STEP_S = 0.25


# The commands a worker gives its engine loop. In the engine process they are the pipe's
# messages (command_pipe): msgspec Structs written as MessagePack arrays, the tag first, and
# read back as what they were, their requests as PackedRequests.
class Offer(msgspec.Struct, Generic[_R], array_like=True, frozen=True, gc=False, tag="offer"):
    """Jobs the worker is about to start (one round: a piece's); none runs until an admit
    of the round names it."""

    round: int
    jobs: Sequence[tuple[str, _R]]


class Admit(msgspec.Struct, Generic[_R], array_like=True, frozen=True, gc=False, tag="admit"):
    """Jobs to start in one pass: a request of None is the one offered in ``round``. An
    add_many() is an admit of no round, every request given whole."""

    round: int | None
    jobs: Sequence[tuple[str, _R | None]]


class Cancel(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="cancel"):
    job_id: str


class Stop(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="stop"):
    pass


Command = Offer[EngineRequest] | Admit[EngineRequest] | Cancel | Stop
# Where the loop's thread takes its commands when they do not come through the loop's own
# methods: called with block=True only while the engine is idle, it returns the commands
# that have arrived (at least one when blocking). The engine process's command pipe is one
# (engine_process: read by the stepping thread itself, no thread in between).
CommandSource = Callable[[bool], list[Command]]
# Commands that only bring jobs in: a step's wait for the GPU applies them.
_TAKE_IN = (Offer, Admit)


class StepReport(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="report"):
    """What one pass of the loop produced, handed to the event loop in one piece (in the
    engine process, one message of its report pipe)."""

    outputs: list[EngineOutput]
    step_seconds: float | None
    active_jobs: int
    cache: CacheUsage
    finished_at: float = msgspec.field(default_factory=time.time)
    fatal: str | None = None


ReportSink = Callable[[StepReport], None]


class EngineRunner(Protocol):
    """What the worker drives: an engine on a thread (EngineLoop) or in a process of its own
    (exlq.worker.engine_process.EngineProcess)."""

    name: str
    capacity: int
    info: dict[str, str]

    def start(self, report: ReportSink, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Begin; each step's report goes to ``report``: with ``loop``, called on that
        loop's thread; without, from a thread of the runner's."""
        ...

    def add_many(self, jobs: Sequence[tuple[str, EngineRequest]]) -> None:
        """Hand (job id, request) pairs over together: the engine admits them in one pass."""
        ...

    def offer(self, round_id: int, jobs: Sequence[tuple[str, EngineRequest]]) -> None:
        """Jobs the worker is about to start (one round: the entries of one piece, offered
        in one or more calls before the start script's verdict). The engine may check and
        build them now, but runs none until admit() names it."""
        ...

    def admit(self, round_id: int, jobs: Sequence[tuple[str, EngineRequest | None]]) -> None:
        """End a round: start these jobs in one pass, in order (a request of None: the one
        offered under that id in this round), and drop the round's other offers."""
        ...

    def cancel(self, job_id: str) -> None: ...

    def stop(self, timeout: float | None = None) -> None: ...

    def close(self) -> None: ...


class EngineLoop:
    """Runs an engine on a thread of its own. Commands come in through a queue, or from a
    command source the thread reads itself; each pass's outputs go out through ``report``,
    which must be thread-safe."""

    def __init__(
        self,
        engine: Engine,
        collections: HeldCollections | None = None,
        commands: CommandSource | None = None,
    ) -> None:
        self.engine = engine
        self.name = engine.name
        self.capacity = engine.capacity
        self.info = engine.info()
        # Declared capabilities: a step that waits for its device runs the loop's work in
        # that wait; an engine that prepares jobs readies them before their start.
        self._waits = engine if isinstance(engine, UsesDeviceWait) else None
        self._prepares = engine if isinstance(engine, PreparesJobs) else None
        # In a process of the engine's own: Python's automatic collections are held off
        # from a burst's arrival at an idle engine to its first decode step's wait for the
        # GPU (gc_pauses.HeldCollections). None: CPython collects where it will.
        self.collections = collections
        self._report: ReportSink = _no_sink
        # Commands come through add_many() and the like into this queue, or, given a
        # source, from there alone (stop() then only waits for the thread).
        self._commands: queue.SimpleQueue[Command] = queue.SimpleQueue()
        self._source = commands
        self._thread = threading.Thread(target=self._run, name="exlq-engine", daemon=True)
        # A step's report that only continues streams waits here for the
        # next step's wait for the GPU (Engine.set_wait_work), and goes out in it.
        self._held: StepReport | None = None
        self._held_error: BaseException | None = None
        self._step_waited = False  # the last step ran the wait work: the engine waits
        self._streaming: set[str] = set()  # jobs whose first text has been reported
        # The jobs that arrive while a step waits for the GPU are added
        # in that wait, and the engine readies the next step there. Commands taken there
        # behind the first that is not an add wait here, in order, for the step's end; what
        # the wait's adds and readying end goes into the pass's outputs.
        self._deferred: list[Command] = []
        self._outputs: list[EngineOutput] = []
        # Jobs offered ahead of their start, by round, until the round's admit: what the
        # engine's prepare() returned, or the error the job fails with if it is admitted.
        self._offered: dict[int, dict[str, object]] = {}

    def start(self, report: ReportSink, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._report = report  # called on the engine's thread
        if loop is not None:

            def on_loop(step: StepReport) -> None:
                loop.call_soon_threadsafe(report, step)

            self._report = on_loop
        self._thread.start()

    def close(self) -> None:
        self.engine.close()

    def add_many(self, jobs: Sequence[tuple[str, EngineRequest]]) -> None:
        if jobs:
            self._put(Admit(None, jobs))

    def offer(self, round_id: int, jobs: Sequence[tuple[str, EngineRequest]]) -> None:
        if jobs:
            self._put(Offer(round_id, jobs))

    def admit(self, round_id: int, jobs: Sequence[tuple[str, EngineRequest | None]]) -> None:
        self._put(Admit(round_id, jobs))

    def cancel(self, job_id: str) -> None:
        self._put(Cancel(job_id))

    def _put(self, command: Command) -> None:
        if self._source is not None:
            raise RuntimeError("this engine loop takes its commands from its command source")
        self._commands.put(command)

    def stop(self, timeout: float | None = None) -> None:
        """Stop the loop and wait for its thread. With a command source of its own, the stop
        must come from there (a Stop); this only waits."""
        if self._source is None:
            self._commands.put(Stop())
        self._thread.join(timeout)

    def _run(self) -> None:
        if self._waits is not None:
            self._waits.set_wait_work(self._in_wait)
        try:
            while True:
                outputs: list[EngineOutput] = []
                self._outputs = outputs
                # Block only while idle; with work in flight, take what has arrived and step.
                idle = self.engine.active_jobs == 0
                if idle:
                    self._while_idle()
                commands = self._take_commands(block=idle)
                if idle and self.collections is not None:
                    self.collections.hold()  # a burst begins: no pause until its first wait
                if not self._apply(commands, outputs):
                    self._send_held()
                    return
                self._step_waited = False
                step_seconds = self._step(outputs) if self.engine.active_jobs else None
                self._send_held()  # if the step did not wait for the GPU
                if outputs or step_seconds is not None:
                    self._emit(
                        StepReport(
                            outputs,
                            step_seconds,
                            self.engine.active_jobs,
                            self.engine.cache_usage(),
                        )
                    )
        except EngineDead as exc:
            log.critical("engine is dead: %s", exc)
            self._report_fatal(str(exc))
        except BaseException as exc:  # the thread must never die silently
            log.critical("engine loop crashed", exc_info=True)
            self._report_fatal(repr(exc))
        finally:
            self._leave()

    def _leave(self) -> None:
        """A loop that has ended leaves no work in the engine: another may drive it."""
        if self._waits is not None:
            self._waits.set_wait_work(None)
        if self.collections is not None:
            self.collections.release()

    def _report_fatal(self, reason: str) -> None:
        held, self._held = self._held, None
        if held is not None and self._held_error is None:
            self._report(held)  # what was made before comes first
        self._report(StepReport([], None, 0, CacheUsage(0, 0), fatal=reason))

    def _emit(self, report: StepReport) -> None:
        """Send the report now, or hold it for the next step's wait for the GPU. A first
        text, an end and an idle engine go at once: holding them would add to a job's time
        to first token or to its result, or wait for a step that will not come. Nor is a
        report held after a step that did not wait (an engine or a sampler that never
        does, a prefill): the next one would likely not wait either, and the report would
        only come a step late."""
        if (
            not self._starts_or_ends(report.outputs)
            and self._step_waited
            and self.engine.active_jobs
        ):
            self._held = report
        else:
            self._report(report)

    def _starts_or_ends(self, outputs: list[EngineOutput]) -> bool:
        found = False
        for output in outputs:
            if isinstance(output, TokenChunk):
                if output.job_id not in self._streaming:
                    self._streaming.add(output.job_id)
                    found = True
            else:
                self._streaming.discard(output.job_id)
                found = True
        return found

    def _send_held(self) -> None:
        if self._held_error is not None:  # the sink failed inside the step
            raise self._held_error
        report, self._held = self._held, None
        if report is not None:
            self._report(report)

    def _in_wait(self) -> None:
        """The engine's wait work, run while the GPU runs the step: the held report goes
        out, then the jobs that have arrived are added and the engine
        readies the next step: it may build the jobs that step will start;
        last, collections held since a burst began come back, the young one due first. A
        failing sink must not fail the step's jobs: its error is raised after the step."""
        self._step_waited = True
        try:
            self._send_held()
        except BaseException as exc:
            self._held_error = exc
        self._add_arrived()
        assert self._waits is not None  # only an engine that waits runs this
        self._outputs += self._waits.prepare_next_step()
        if self.collections is not None:
            self.collections.release()

    def _add_arrived(self) -> None:
        """Add the jobs of the add commands that have arrived, up to the first command of
        another kind: that one and those behind it wait for the step's end, so commands
        keep their order and a cancel never runs inside a step."""
        commands = self._take_commands(block=False)
        adds = next(
            (i for i, command in enumerate(commands) if not isinstance(command, _TAKE_IN)),
            len(commands),
        )
        self._deferred = commands[adds:]
        self._apply(commands[:adds], self._outputs)

    def _take_commands(self, block: bool) -> list[Command]:
        commands, self._deferred = self._deferred, []
        commands += (self._source or self._queued)(block and not commands)
        return commands

    def _queued(self, block: bool) -> list[Command]:
        """The commands put through this loop's methods."""
        commands = [self._commands.get()] if block else []
        while True:
            try:
                commands.append(self._commands.get_nowait())
            except queue.Empty:
                return commands

    def _apply(self, commands: list[Command], outputs: list[EngineOutput]) -> bool:
        for command in commands:
            if isinstance(command, Stop):
                return False
            if isinstance(command, Cancel):
                ended = self.engine.cancel(command.job_id)
                if ended is not None:
                    outputs.append(ended)
            elif isinstance(command, Offer):
                offered = self._offered.setdefault(command.round, {})
                for job_id, request in command.jobs:
                    offered[job_id] = self._prepare(job_id, request)
                if tracing.tracer is not None:
                    tracing.tracer.stage("offer_prepared", n=len(command.jobs))
            else:
                self._admit(command, outputs)
                if tracing.tracer is not None:
                    tracing.tracer.stage("jobs_added", n=len(command.jobs))
        return True

    def _admit(self, command: Admit[EngineRequest], outputs: list[EngineOutput]) -> None:
        """Start the round's named jobs in order; its other offers are dropped with it."""
        offered = {} if command.round is None else self._offered.pop(command.round, {})
        for job_id, request in command.jobs:
            error = self._start(job_id, request, offered.get(job_id))
            if error is not None:
                outputs.append(error)

    def _start(
        self, job_id: str, request: EngineRequest | None, prepared: object
    ) -> JobErrored | None:
        """Start one job: given whole (``request``), or as offered (``prepared``: what
        prepare() returned, its error, or None if never offered)."""
        if request is not None:
            started = _intake(job_id, functools.partial(self.engine.add, job_id, request))
        elif prepared is None:  # the worker named a job it did not offer: its bug, not the job's
            return JobErrored(job_id, "internal_error", "the job was started without its request")
        elif isinstance(prepared, JobErrored):
            return prepared
        elif self._prepares is None:  # offered as it came: nothing was readied
            add = functools.partial(self.engine.add, job_id, cast(EngineRequest, prepared))
            started = _intake(job_id, add)
        else:
            started = _intake(job_id, functools.partial(self._prepares.admit, job_id, prepared))
        return started if isinstance(started, JobErrored) else None

    def _prepare(self, job_id: str, request: EngineRequest) -> object:
        """An offered job as the engine readied it, or its request where the engine does
        not prepare jobs; the error it fails with if its request is bad."""
        if self._prepares is None:
            return request
        return _intake(job_id, functools.partial(self._prepares.prepare, job_id, request))

    def _while_idle(self) -> None:
        """Before an idle engine waits for commands: build the jobs offered, if any; else
        nothing is on its way to the GPU, and collections held come back."""
        if self._offered and self._prepares is not None:
            self._build_ahead(self._prepares)
        elif self.collections is not None:
            self.collections.release()

    def _build_ahead(self, engine: PreparesJobs) -> None:
        """While idle, with jobs offered and their start awaited: the engine may build what
        its first step will start, in the time the worker's start script takes."""
        prepared = [
            offered
            for by_id in self._offered.values()
            for offered in by_id.values()
            if not isinstance(offered, JobErrored)
        ]
        try:
            engine.build_ahead(prepared)
        except EngineDead:
            raise
        except Exception:  # the jobs are built, or fail, at their step as without it
            log.exception("building offered jobs ahead failed")
        if tracing.tracer is not None:
            tracing.tracer.stage("built_ahead")

    def _step(self, outputs: list[EngineOutput]) -> float:
        jobs = self.engine.active_jobs
        if tracing.tracer is not None:
            tracing.tracer.stage("step_begun", active=jobs)
        started = time.perf_counter()
        try:
            outputs.extend(self.engine.step())
        except EngineDead:
            raise
        except Exception as exc:
            # One bad step fails the jobs in it, not the worker.
            log.exception("engine step failed; failing its %d jobs", self.engine.active_jobs)
            message = describe_error(exc)
            outputs.extend(
                JobErrored(job_id, "engine_error", message) for job_id in self.engine.abort_all()
            )
        seconds = time.perf_counter() - started
        if tracing.tracer is not None:
            tracing.tracer.stage("step_ended")
        if self.collections is not None:
            # Steps that never wait (prefills, an engine without waits) end the hold too.
            self.collections.step_ran(HELD_STEPS_MAX)
        if seconds > SLOW_STEP_S:
            # Usually kernel compilation for a new shape, or many prefills in one iteration.
            log.warning("engine step took %.0f ms with %d jobs", seconds * 1000, jobs)
        return seconds


# Steps after which collections held since a burst began come back though no step waited
# for the GPU: a burst's first slice is one prefill step, and its later ones start in the
# decode steps' waits.
HELD_STEPS_MAX = 4


def _intake(job_id: str, call: Callable[[], _T]) -> _T | JobErrored:
    """Run one of the engine's intake calls for a job (add, prepare, admit): what it
    returns, or the job's error if the engine refused it."""
    try:
        return call()
    except InvalidRequest as exc:
        return JobErrored(job_id, "invalid_request", str(exc))
    except EngineDead:
        raise
    except Exception as exc:
        log.exception("engine refused job %s", job_id)
        return JobErrored(job_id, "engine_error", describe_error(exc))


def _no_sink(report: StepReport) -> None:
    raise RuntimeError("EngineLoop.start() was not called")

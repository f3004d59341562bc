"""The engine interface: what the worker needs from anything that generates tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass

from exlq.protocol.models import FinishReason, TokenChoices
from exlq.worker.engines.engine_request import EngineRequest


# The outputs are made for every job at every step, on the engine thread, and made again on
# the worker's side of the pipe: unfrozen, one takes about a third of the time to build
# (0.35 against 1.2 us on the development machine); nothing changes them once made.
@dataclass(slots=True)
class TokenChunk:
    """Text a job produced in one step (one token, or a few when stop strings hold text back)."""

    job_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenChoices] | None = None


@dataclass(slots=True)
class JobEnded:
    job_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(slots=True)
class JobErrored:
    job_id: str
    code: str
    message: str


EngineOutput = TokenChunk | JobEnded | JobErrored


@dataclass(frozen=True, slots=True)
class CacheUsage:
    pages_used: int
    pages_total: int


class EngineUnavailable(RuntimeError):
    """The engine cannot start here (no GPU, missing package, bad model); the message says why."""


@dataclass(frozen=True, slots=True)
class EngineSetup:
    """How a loaded engine runs, as loading turned out (a setting may have fallen back):
    the log and ``exlq_worker_info`` say it."""

    attention: str = "none"
    decode_graphs: bool = False
    gpu_sampling: bool = False
    prefill_batch_tokens: int = 0  # 0: one job a prefill pass
    admit_prompt_tokens: int = 0  # 0: a step starts every waiting job that fits
    gpu_embedding: bool = False  # the token-embedding table sits on the GPU


def describe_error(exc: BaseException) -> str:
    """An exception as a job's error message: its type and what it says."""
    return f"{type(exc).__name__}: {exc}"


class EngineDead(RuntimeError):
    """The engine can serve nothing more; the process should exit so it is restarted."""


@dataclass(frozen=True, slots=True)
class _Unprepared:
    """What Engine.prepare() returns by default: the request, for admit() to add."""

    request: EngineRequest


class Engine(ABC):
    """Generates tokens for many jobs at once. Every method runs on the engine thread."""

    name: str
    capacity: int
    attention: str = "none"
    decode_graphs: bool = False
    gpu_sampling: bool = False
    prefill_batch_tokens: int = 0
    admit_prompt_tokens: int = 0
    gpu_embedding: bool = False
    wait_work: Callable[[], None] | None = None

    @property
    def setup(self) -> EngineSetup:
        return EngineSetup(
            self.attention,
            self.decode_graphs,
            self.gpu_sampling,
            self.prefill_batch_tokens,
            self.admit_prompt_tokens,
            self.gpu_embedding,
        )

    @abstractmethod
    def add(self, job_id: str, request: EngineRequest) -> None:
        """Start a job. Raises InvalidRequest if it can never run as written."""

    def prepare(self, job_id: str, request: EngineRequest) -> object:
        """Check a request the worker is about to start, and do what running it will need,
        without running it: what it returns goes to admit() if the worker starts the job,
        and is dropped if not. Raises InvalidRequest as add() would. Default: nothing ahead;
        admit() adds the request."""
        return _Unprepared(request)

    def admit(self, job_id: str, prepared: object) -> None:
        """Start a job that prepare() readied (same errors as add())."""
        if not isinstance(prepared, _Unprepared):
            raise TypeError(f"admit() takes what prepare() returned, not {type(prepared)}")
        self.add(job_id, prepared.request)

    def build_ahead(self, prepared: list[object]) -> None:  # noqa: B027 - optional hook
        """Called while the engine is idle and the worker is about to start the jobs these
        were prepared for (in order): the engine may build the ones its next step would
        start, so the step need not. It must leave a job it cannot build to admit() or
        step() to fail. Default: nothing."""

    @abstractmethod
    def cancel(self, job_id: str) -> JobEnded | None:
        """Stop a job at once and free its slot; returns its end, or None if it is unknown."""

    @abstractmethod
    def step(self) -> list[EngineOutput]:
        """Run one iteration for every active job and return what it produced."""

    def set_wait_work(self, work: Callable[[], None] | None) -> None:
        """Work a step may run on the engine thread while it waits for its device: once the
        step's forward pass is queued on the GPU, before the wait for its result. It must not
        raise. The engine loop sends the previous step's report there, adds the jobs that
        have arrived and calls prepare_next_step(), so add() and prepare_next_step() may be
        called from inside step(). An engine that never waits may ignore it; the loop then
        does all of it between steps."""
        self.wait_work = work

    def prepare_next_step(self) -> list[EngineOutput]:
        """Readying for the next step that may run inside this one's wait for its device
        (the engine loop calls it there, after adding the jobs that arrived): an engine may
        build the jobs the next step will start. Returns the ends of jobs it could not ready.
        Default: nothing to do."""
        return []

    @abstractmethod
    def abort_all(self) -> list[str]:
        """Drop every job after a failed step; returns their ids. Raises EngineDead if the
        engine cannot be brought back to a clean state."""

    @property
    @abstractmethod
    def active_jobs(self) -> int: ...

    @abstractmethod
    def cache_usage(self) -> CacheUsage: ...

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""

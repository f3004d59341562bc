"""The engine interface: what the worker needs from anything that generates tokens."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any

import msgspec

from exlq.protocol.models import FinishReason, TokenChoices
from exlq.worker.engines.engine_request import EngineRequest


# The outputs are made for every job at every step, on the engine thread, and cross the
# engine process's pipe in its step report (engine_process): msgspec Structs, written and
# read as MessagePack arrays whose first item is the tag. Not tracked by the cyclic
# collector (gc=False): they hold no reference cycle, and one is made per job per step.
class TokenChunk(msgspec.Struct, array_like=True, gc=False, tag=0):
    """Text a job produced in one step (one token, or a few when stop strings hold text back)."""

    job_id: str
    text: str
    token_ids: list[int]
    logprobs: list[TokenChoices] | None = None


class JobEnded(msgspec.Struct, array_like=True, gc=False, tag=1):
    job_id: str
    finish_reason: FinishReason
    prompt_tokens: int
    completion_tokens: int
    # Prompt tokens found in the prefix cache; None where the job's prompt was not looked
    # up in one (the engine has none, or the job ended before its prefill), so that the
    # prefix cache metrics count only real lookups.
    cached_tokens: int | None = None
    # Speculative decoding: the tokens drafted for this job and verified by the model, and
    # those it accepted; None where the engine drafts none.
    draft_tokens: int | None = None
    accepted_draft_tokens: int | None = None


class JobErrored(msgspec.Struct, array_like=True, gc=False, tag=2):
    job_id: str
    code: str
    message: str


EngineOutput = TokenChunk | JobEnded | JobErrored


class CacheUsage(msgspec.Struct, array_like=True, frozen=True, gc=False):
    pages_used: int
    pages_total: int


class EngineUnavailable(RuntimeError):
    """The engine cannot start here (no GPU, missing package, bad model); the message says why."""


def describe_error(exc: BaseException) -> str:
    """An exception as a job's error message: its type and what it says."""
    return f"{type(exc).__name__}: {exc}"


class EngineDead(RuntimeError):
    """The engine can serve nothing more; the process should exit so it is restarted."""


def reset_gpu_engine(drop_jobs: Callable[[], object], torch: Any) -> None:
    """A GPU engine's abort_all after a failed step: drop every job (`drop_jobs`), then wait
    for the GPU. EngineDead where either fails: a CUDA error is sticky, nothing will run
    again."""
    try:
        drop_jobs()
        torch.cuda.synchronize()
    except Exception as exc:
        raise EngineDead(f"the GPU cannot run more after a failed step: {exc}") from exc


class Engine(ABC):
    """Generates tokens for many jobs at once. Every method runs on the engine thread.

    The contract every engine keeps: take jobs (add), stop one (cancel), step every job
    once and say what each produced (step), drop everything after a failed step
    (abort_all), and report its load (capacity, active_jobs, cache_usage). What an engine
    can do beyond that it declares by also deriving from a capability below
    (PreparesJobs, UsesDeviceWait); the engine loop uses a capability only where the
    engine declares it.
    """

    name: str
    capacity: int  # jobs the engine runs at once

    @abstractmethod
    def add(self, job_id: str, request: EngineRequest) -> None:
        """Start a job. Raises InvalidRequest if it can never run as written."""

    @abstractmethod
    def cancel(self, job_id: str) -> JobEnded | None:
        """Stop a job at once and free its slot; returns its end, or None if it is unknown."""

    @abstractmethod
    def step(self) -> list[EngineOutput]:
        """Run one iteration for every active job and return what it produced."""

    @abstractmethod
    def abort_all(self) -> list[str]:
        """Drop every job after a failed step; returns their ids. Raises EngineDead if the
        engine cannot be brought back to a clean state."""

    @property
    @abstractmethod
    def active_jobs(self) -> int: ...

    @abstractmethod
    def cache_usage(self) -> CacheUsage: ...

    def info(self) -> dict[str, str]:
        """How the loaded engine runs (a setting may have fallen back at load), as short
        strings: the start-up log and the ``exlq_worker_info`` metric's labels show them."""
        return {}

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release the engine's resources."""


class PreparesJobs(ABC):
    """Capability: check and build jobs before the worker has decided to start them, so
    that an engine's per-job work overlaps the worker's round trip to Redis."""

    @abstractmethod
    def prepare(self, job_id: str, request: EngineRequest) -> object:
        """Check a request the worker is about to start and do what running it will need,
        without running it: what it returns goes to admit() if the worker starts the job,
        and is dropped if not. Raises InvalidRequest as add() would."""

    @abstractmethod
    def admit(self, job_id: str, prepared: object) -> None:
        """Start a job that prepare() readied (same errors as add())."""

    def build_ahead(self, prepared: list[object]) -> None:  # noqa: B027 - optional hook
        """Called while the engine is idle and the worker is about to start the jobs these
        were prepared for (in order): the engine may build the ones its next step would
        start, so the step need not. It must leave a job it cannot build to admit() or
        step() to fail. Default: nothing."""


class UsesDeviceWait:
    """Capability: a step that waits for its device (a GPU) runs the engine loop's work in
    that wait: the last step's report, the jobs that arrived, readying the next step."""

    wait_work: Callable[[], None] | None = None

    def set_wait_work(self, work: Callable[[], None] | None) -> None:
        """Work a step runs on the engine thread once its forward pass is queued on the
        device, before it waits for the result. It must not raise; add() and
        prepare_next_step() may be called from inside step()."""
        self.wait_work = work

    def prepare_next_step(self) -> list[EngineOutput]:
        """Ready the next step inside this one's wait (after the jobs that arrived were
        added): e.g. build the jobs it will start. Returns the ends of jobs it could not
        ready. Default: nothing to do."""
        return []

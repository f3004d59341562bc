"""RunningJob: what the worker knows of one job from its parse on (its stage is job_state's
to move), and the events and result it makes."""

from __future__ import annotations

from dataclasses import dataclass, field

from exlq.protocol.keys import Lane, split_entry_ref
from exlq.protocol.models import (
    DoneEvent,
    ErrorEvent,
    ErrorInfo,
    FinishReason,
    GenerationRequest,
    JobResult,
    JobState,
    RequeuedEvent,
    Timings,
    Usage,
    final_state,
    token_event_json,
)
from exlq.worker.engines.base import JobEnded, TokenChunk
from exlq.worker.job_state import Stage


@dataclass(slots=True, eq=False)
class RunningJob:
    job_id: str
    entry_id: str  # with its lane (keys.entry_ref)
    request: GenerationRequest
    channel: str
    enqueued_at: float  # this host's clock
    # When the command that last gave or renewed this worker's claim on the entry went out
    # (this host's clock): no other worker can take it before the claim idle time after.
    claimed_at: float = 0.0
    stage: Stage = Stage.PARSED
    attempt: int = 0  # the start script's count, once it has judged the job
    started_at: float = 0.0  # when the engine was told to start it (Unix s)
    seq: int = 0
    text_parts: list[str] = field(default_factory=list)
    completion_tokens: int = 0
    first_token_at: float | None = None
    last_token_at: float | None = None
    # Set when the worker, not the engine, chose to stop the job (deadline passed).
    stop_reason: FinishReason | None = None
    lost_announced: bool = False  # its subscribers heard that Redis lost it

    @property
    def lane(self) -> Lane:
        """The priority lane whose stream holds the job's entry."""
        return split_entry_ref(self.entry_id)[1]

    def _next_seq(self) -> int:
        seq = self.seq
        self.seq += 1
        return seq

    def requeued_event(self, reason: str) -> str:
        """The first event of a retry: subscribers drop the text of earlier attempts."""
        event = RequeuedEvent(
            id=self.job_id, seq=self._next_seq(), attempt=self.attempt, reason=reason
        )
        return event.model_dump_json()

    def token_event(self, chunk: TokenChunk, now: float) -> str:
        """Record a chunk and return its event as JSON."""
        if self.first_token_at is None:
            self.first_token_at = now
        self.last_token_at = now
        self.text_parts.append(chunk.text)
        self.completion_tokens += len(chunk.token_ids)
        return token_event_json(
            self.job_id, self._next_seq(), self.attempt, chunk.text, chunk.token_ids, chunk.logprobs
        )

    def timings(self, now: float) -> Timings:
        first = None if self.first_token_at is None else self.first_token_at - self.enqueued_at
        return Timings(
            queued_s=max(self.started_at - self.enqueued_at, 0.0),
            first_token_s=first,
            total_s=max(now - self.enqueued_at, 0.0),
        )

    def finish(self, ended: JobEnded, now: float) -> tuple[JobState, str, str]:
        """The final state, the done event and the result, as JSON."""
        reason: FinishReason = self.stop_reason or ended.finish_reason
        usage = Usage(
            prompt_tokens=ended.prompt_tokens,
            completion_tokens=ended.completion_tokens,
            cached_tokens=ended.cached_tokens or 0,
        )
        timings = self.timings(now)
        event = DoneEvent(
            id=self.job_id,
            seq=self._next_seq(),
            attempt=self.attempt,
            finish_reason=reason,
            usage=usage,
            timings=timings,
        )
        state = final_state(reason)
        result = JobResult(
            id=self.job_id,
            state=state,
            text="".join(self.text_parts),
            finish_reason=reason,
            usage=usage,
            timings=timings,
            attempts=self.attempt,
        )
        return state, event.model_dump_json(), result.model_dump_json()

    def lost_event(self, consumer: str) -> str:
        """The error event that tells subscribers Redis lost the job while it ran here."""
        error = ErrorInfo(
            code="lost",
            message=(
                f"Redis lost job {self.job_id} while worker {consumer} ran it (a restart "
                "without persistence, or a flush): nothing will finish it; submit it again"
            ),
        )
        event = ErrorEvent(id=self.job_id, seq=self._next_seq(), attempt=self.attempt, error=error)
        return event.model_dump_json()

    def fail(self, code: str, message: str, now: float) -> tuple[str, str]:
        """The error event and the failed result, as JSON."""
        error = ErrorInfo(code=code, message=message)
        event = ErrorEvent(id=self.job_id, seq=self._next_seq(), attempt=self.attempt, error=error)
        result = JobResult(
            id=self.job_id,
            state="failed",
            text="".join(self.text_parts),
            timings=self.timings(now),
            error=error,
            attempts=self.attempt,
        )
        return event.model_dump_json(), result.model_dump_json()

"""EchoEngine: streams text derived from the prompt at a set pace, with no GPU."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from exlq.protocol.models import FinishReason, InvalidRequest
from exlq.worker.engines.base import (
    CacheUsage,
    Engine,
    EngineOutput,
    JobEnded,
    TokenChunk,
    UsesDeviceWait,
)
from exlq.worker.engines.engine_request import EngineRequest
from exlq.worker.engines.stop_strings import first_stop, held_back

# The echo engine's "tokens" are the prompt's words, cycled; one id per word position.
_PAGE_TOKENS = 256


def prompt_words(request: EngineRequest) -> list[str]:
    if request.prompt is not None:
        text = request.prompt
    elif request.messages is not None:
        text = request.messages[-1].content
    else:
        text = " ".join(f"t{token_id}" for token_id in request.prompt_ids or [])
    return text.split() or ["echo"]


def echo_text(request: EngineRequest) -> str:
    """The whole text the echo engine produces for a request (before stop strings)."""
    words = prompt_words(request)
    return "".join(" " + words[i % len(words)] for i in range(request.max_new_tokens))


@dataclass
class _EchoJob:
    request: EngineRequest
    words: list[str]
    prompt_tokens: int
    emitted: int = 0
    sent: int = 0
    text: list[str] = field(default_factory=list)


class EchoEngine(Engine, UsesDeviceWait):
    """Deterministic load-test engine: one word per job per step, ``tokens_per_second`` steps/s.
    Its pause between steps stands for a GPU's forward pass, so it runs the loop's wait work
    there."""

    name = "echo"

    def __init__(self, capacity: int, tokens_per_second: float) -> None:
        self.capacity = capacity
        self.step_seconds = 1.0 / tokens_per_second
        self._jobs: dict[str, _EchoJob] = {}
        self._next_step_at = 0.0

    def add(self, job_id: str, request: EngineRequest) -> None:
        if request.constraint is not None:
            # Its text is the prompt's words: it could honour no schema or pattern.
            raise InvalidRequest(
                "the echo engine does not constrain output: response_format / regex need "
                "the exllamav2 or transformers engine"
            )
        words = prompt_words(request)
        self._jobs[job_id] = _EchoJob(request, words, prompt_tokens=len(words))

    def cancel(self, job_id: str) -> JobEnded | None:
        job = self._jobs.pop(job_id, None)
        if job is None:
            return None
        return JobEnded(job_id, "cancelled", job.prompt_tokens, job.emitted)

    def step(self) -> list[EngineOutput]:
        self._pace()
        outputs: list[EngineOutput] = []
        for job_id, job in list(self._jobs.items()):
            outputs.extend(self._advance(job_id, job))
        return outputs

    def _advance(self, job_id: str, job: _EchoJob) -> list[EngineOutput]:
        job.text.append(" " + job.words[job.emitted % len(job.words)])
        job.emitted += 1
        full = "".join(job.text)
        stop_at = first_stop(job.request.stop, full)
        done = stop_at is not None or job.emitted >= job.request.max_new_tokens
        if stop_at is not None:
            end = stop_at
        elif done:
            end = len(full)
        else:
            # Hold back text that may be the start of a stop string, as real engines do.
            end = len(full) - held_back(job.request.stop, full)
        outputs: list[EngineOutput] = []
        if end > job.sent:
            outputs.append(TokenChunk(job_id, full[job.sent : end], [job.emitted - 1]))
            job.sent = end
        if done:
            del self._jobs[job_id]
            reason: FinishReason = "stop" if stop_at is not None else "length"
            outputs.append(JobEnded(job_id, reason, job.prompt_tokens, job.emitted))
        return outputs

    def _pace(self) -> None:
        now = time.monotonic()
        if self._next_step_at > now and self.wait_work is not None:
            # Its pause stands for a GPU's forward pass: the loop's work may run in it.
            self.wait_work()
            now = time.monotonic()
        if self._next_step_at > now:
            time.sleep(self._next_step_at - now)
        self._next_step_at = max(now, self._next_step_at) + self.step_seconds

    def abort_all(self) -> list[str]:
        ids = list(self._jobs)
        self._jobs.clear()
        return ids

    @property
    def active_jobs(self) -> int:
        return len(self._jobs)

    def cache_usage(self) -> CacheUsage:
        tokens = sum(job.prompt_tokens + job.emitted for job in self._jobs.values())
        pages_total = max(self.capacity * 4, 1)
        return CacheUsage(min(-(-tokens // _PAGE_TOKENS), pages_total), pages_total)

"""Running jobs on an engine directly, step by step, and what they made."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exlq.protocol.models import ChatMessage, GenerationRequest
from exlq.worker.engines.base import Engine, JobEnded, JobErrored, TokenChunk

CAPITAL = [ChatMessage(role="user", content="What is the capital of France? Answer in one word.")]


def capital(**fields: Any) -> GenerationRequest:
    """The capital-of-France question, greedy unless ``fields`` say otherwise."""
    fields.setdefault("sampling", {"temperature": 0.0})
    fields.setdefault("max_new_tokens", 16)
    return GenerationRequest(messages=CAPITAL, **fields)


@dataclass
class Run:
    """What an engine made, job by job."""

    chunks: dict[str, list[TokenChunk]] = field(default_factory=dict)
    ends: dict[str, JobEnded | JobErrored] = field(default_factory=dict)
    most_jobs_in_a_step: int = 0

    def text(self, job_id: str) -> str:
        return "".join(chunk.text for chunk in self.chunks.get(job_id, []))

    def take(self, outputs: list[Any]) -> None:
        for output in outputs:
            if isinstance(output, TokenChunk):
                self.chunks.setdefault(output.job_id, []).append(output)
            else:
                assert output.job_id not in self.ends
                self.ends[output.job_id] = output


def step_until_idle(engine: Engine, run: Run | None = None, max_steps: int = 400) -> Run:
    run = run if run is not None else Run()
    for _ in range(max_steps):
        if not engine.active_jobs:
            return run
        run.most_jobs_in_a_step = max(run.most_jobs_in_a_step, engine.active_jobs)
        run.take(engine.step())
    raise AssertionError(f"jobs still running after {max_steps} steps")


def alone(engine: Engine, request: GenerationRequest) -> str:
    """The text a job gets with nothing beside it."""
    engine.add("alone", request)
    return step_until_idle(engine).text("alone")

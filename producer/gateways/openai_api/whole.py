"""A whole (non-streamed) answer: every job's events gathered into its JobResult and its
logprobs, then one chat.completion / text_completion body."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.job_errors import error_from_info
from exlq.producer.gateways.openai_api.jobs import JobSet
from exlq.producer.gateways.openai_api.logprobs import CompletionLogprobs, chat_content
from exlq.producer.gateways.openai_api.translate import ParsedRequest, response_from_results
from exlq.protocol.models import (
    DoneEvent,
    ErrorEvent,
    Event,
    JobResult,
    RequeuedEvent,
    TokenEvent,
    final_state,
)


@dataclass
class _Choice:
    """One job's answer so far (a retry starts it over)."""

    job_id: str
    top_count: int | None
    text: list[str] = field(default_factory=list)
    chat_logprobs: list[dict[str, Any]] = field(default_factory=list)
    completion_logprobs: CompletionLogprobs | None = None
    result: JobResult | None = None

    def __post_init__(self) -> None:
        self.restart()

    def restart(self) -> None:
        self.text = []
        self.chat_logprobs = []
        if self.top_count is not None:
            self.completion_logprobs = CompletionLogprobs(self.top_count)

    def take(self, event: Event) -> None:
        if isinstance(event, TokenEvent):
            self.text.append(event.text)
            if self.top_count is not None and self.completion_logprobs is not None:
                self.chat_logprobs += chat_content(event, self.top_count)
                self.completion_logprobs.add(event)
        elif isinstance(event, RequeuedEvent):
            self.restart()
        elif isinstance(event, ErrorEvent):
            raise error_from_info(event.error)
        elif isinstance(event, DoneEvent):
            self.result = JobResult(
                id=self.job_id,
                state=final_state(event.finish_reason),
                text="".join(self.text),
                finish_reason=event.finish_reason,
                usage=event.usage,
                timings=event.timings,
                attempts=event.attempt,
            )

    def logprobs(self, is_chat: bool) -> dict[str, Any] | None:
        if self.top_count is None or self.completion_logprobs is None:
            return None
        if is_chat:
            return {"content": self.chat_logprobs, "refusal": None}
        return self.completion_logprobs.body()


async def whole_response(
    parsed: ParsedRequest, jobs: JobSet, response_id: str, created: int
) -> dict[str, Any]:
    choices = [_Choice(h.id, parsed.top_logprobs) for h in jobs.handles]
    async for index, event in jobs.events():
        choices[index].take(event)
    results = [c.result for c in choices]
    if any(r is None for r in results):
        raise OpenAIError(500, "a job's stream ended without its end", code="internal_error")
    body = response_from_results(parsed, [r for r in results if r], response_id, created)
    for choice, answer in zip(body["choices"], choices, strict=True):
        choice["logprobs"] = answer.logprobs(parsed.is_chat)
    return body

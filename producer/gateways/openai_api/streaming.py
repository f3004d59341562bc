"""A streamed answer: the jobs' events as OpenAI's chunks (``chat.completion.chunk`` or
``text_completion``), one JSON document per server-sent event, ``[DONE]`` at the end. An
error after the stream began cannot change the status any more: it goes as one
``{"error": {...}}`` event and the stream ends, as OpenAI's own server does."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.job_errors import error_from_info
from exlq.producer.gateways.openai_api.jobs import JobSet
from exlq.producer.gateways.openai_api.logprobs import CompletionLogprobs, chat_content
from exlq.producer.gateways.openai_api.translate import (
    ParsedRequest,
    openai_finish_reason,
    usage_body,
)
from exlq.protocol.models import DoneEvent, ErrorEvent, Event, RequeuedEvent, TokenEvent, Usage

DONE = "[DONE]"


@dataclass
class _Replay:
    """What one choice has sent. A retry (requeued) starts the job's text over: text that
    repeats what was sent is skipped; text that differs cannot be taken back, so it ends
    the stream with an error."""

    sent: str = ""
    attempt: str = ""
    completion_logprobs: CompletionLogprobs | None = field(default=None)

    def new_text(self, text: str) -> str:
        self.attempt += text
        if not (self.attempt.startswith(self.sent) or self.sent.startswith(self.attempt)):
            raise OpenAIError(500, "the job was retried and its text changed", code="job_restarted")
        new = self.attempt[len(self.sent) :]
        self.sent = max(self.sent, self.attempt, key=len)
        return new


class ChunkWriter:
    """Builds the chunks of one streamed response."""

    def __init__(self, parsed: ParsedRequest, response_id: str, created: int) -> None:
        self.parsed = parsed
        self._head = {
            "id": response_id,
            "object": "chat.completion.chunk" if parsed.is_chat else "text_completion",
            "created": created,
            "model": parsed.model,
            "system_fingerprint": None,
        }
        if parsed.is_chat:
            self._head["service_tier"] = parsed.service_tier
        top = parsed.top_logprobs
        self.replays = [
            _Replay(completion_logprobs=None if top is None else CompletionLogprobs(top))
            for _ in range(parsed.n)
        ]
        self.usages: list[Usage] = []

    def chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> str:
        body: dict[str, Any] = {**self._head, "choices": choices}
        if self.parsed.include_usage:
            body["usage"] = usage
        return json.dumps(body)

    def first_chunks(self) -> list[str]:
        """Chat's first chunk per choice carries the role, as OpenAI's does."""
        if not self.parsed.is_chat:
            return []
        return [
            self.chunk([self._choice(i, {"delta": {"role": "assistant", "content": ""}})])
            for i in range(self.parsed.n)
        ]

    def from_event(self, index: int, event: Event) -> str | None:
        """The chunk for one event, or None for an event that sends nothing."""
        replay = self.replays[index]
        if isinstance(event, RequeuedEvent):
            replay.attempt = ""
            return None
        if isinstance(event, ErrorEvent):
            raise error_from_info(event.error)
        if isinstance(event, DoneEvent):
            self.usages.append(event.usage)
            reason = openai_finish_reason(event.finish_reason)
            empty: dict[str, Any] = {"delta": {}} if self.parsed.is_chat else {"text": ""}
            return self.chunk([self._choice(index, empty, finish_reason=reason)])
        text = replay.new_text(event.text)
        if not text:
            return None
        return self.chunk([self._choice(index, self._text(replay, event, text))])

    def _text(self, replay: _Replay, event: TokenEvent, text: str) -> dict[str, Any]:
        top = self.parsed.top_logprobs
        if self.parsed.is_chat:
            logprobs = None
            if top is not None:
                logprobs = {"content": chat_content(event, top), "refusal": None}
            return {"delta": {"content": text}, "logprobs": logprobs}
        completion = replay.completion_logprobs
        return {"text": text, "logprobs": None if completion is None else completion.add(event)}

    def _choice(
        self, index: int, fields: dict[str, Any], finish_reason: str | None = None
    ) -> dict[str, Any]:
        return {"index": index, "logprobs": None, **fields, "finish_reason": finish_reason}

    def usage_chunk(self) -> str | None:
        if not self.parsed.include_usage:
            return None
        return self.chunk([], usage=usage_body(self.usages))


async def stream_chunks(writer: ChunkWriter, jobs: JobSet) -> AsyncIterator[str]:
    """The SSE data of the whole stream. Cancelled (the client went away) or ended by an
    error, it cancels the jobs that still run."""
    try:
        for first in writer.first_chunks():
            yield first
        async for index, event in jobs.events():
            chunk = writer.from_event(index, event)
            if chunk is not None:
                yield chunk
        usage = writer.usage_chunk()
        if usage is not None:
            yield usage
        yield DONE
    except OpenAIError as exc:
        yield json.dumps(exc.body())
    finally:
        jobs.abandon()

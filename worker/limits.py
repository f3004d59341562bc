"""RequestLimits: what one worker accepts, beyond the wire contract's own bounds."""

from __future__ import annotations

import json
from dataclasses import dataclass

from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.settings import WorkerSettings


@dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int
    max_prompt_chars: int
    max_messages: int
    max_metadata_bytes: int
    max_new_tokens: int

    @classmethod
    def from_settings(cls, settings: WorkerSettings) -> RequestLimits:
        return cls(
            max_request_bytes=settings.max_request_bytes,
            max_prompt_chars=settings.max_prompt_chars,
            max_messages=settings.max_messages,
            max_metadata_bytes=settings.max_metadata_bytes,
            max_new_tokens=settings.max_new_tokens,
        )

    def check_size(self, payload: bytes) -> None:
        """Before decoding: refuse what is too large to parse at all."""
        if len(payload) > self.max_request_bytes:
            raise InvalidRequest(
                f"request: {len(payload)} bytes is over this worker's limit of "
                f"{self.max_request_bytes} (EXLQ_MAX_REQUEST_BYTES)"
            )

    def check(self, request: GenerationRequest) -> None:
        """After decoding: each limit refused with the field and the setting that sets it."""
        if request.max_new_tokens > self.max_new_tokens:
            raise InvalidRequest(
                f"max_new_tokens: {request.max_new_tokens} is over this worker's limit of "
                f"{self.max_new_tokens} (EXLQ_MAX_NEW_TOKENS)"
            )
        if request.messages is not None and len(request.messages) > self.max_messages:
            raise InvalidRequest(
                f"messages: {len(request.messages)} messages is over this worker's limit of "
                f"{self.max_messages} (EXLQ_MAX_MESSAGES)"
            )
        chars = (
            len(request.prompt or "")
            + sum(len(m.content) for m in request.messages or [])
            + len(request.prompt_ids or ())
        )
        if chars > self.max_prompt_chars:
            raise InvalidRequest(
                f"{request.input_field}: {chars} characters (or tokens) is over this worker's "
                f"limit of {self.max_prompt_chars} (EXLQ_MAX_PROMPT_CHARS)"
            )
        if request.metadata is not None:
            size = len(json.dumps(request.metadata, separators=(",", ":")))
            if size > self.max_metadata_bytes:
                raise InvalidRequest(
                    f"metadata: {size} bytes of JSON is over this worker's limit of "
                    f"{self.max_metadata_bytes} (EXLQ_MAX_METADATA_BYTES)"
                )

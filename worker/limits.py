"""RequestLimits: what one worker accepts, beyond the wire contract's own bounds."""

from __future__ import annotations

import json

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from exlq.protocol.models import GenerationRequest, InvalidRequest


class RequestLimits(BaseSettings):
    """Each limit reads EXLQ_<FIELD>; a request over one is refused, naming it."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_", extra="forbid", frozen=True)

    max_request_bytes: int = Field(1_000_000, ge=256, description="size of one stream entry")
    max_prompt_chars: int = Field(400_000, ge=1, description="prompt, or all messages together")
    max_messages: int = Field(512, ge=1)
    max_metadata_bytes: int = Field(16_384, ge=0)
    max_new_tokens: int = Field(8192, ge=1, le=65_536, description="largest max_new_tokens")

    def check_size(self, size: int) -> None:
        """Before decoding: refuse what is too large to parse at all (``size`` bytes)."""
        if size > self.max_request_bytes:
            raise InvalidRequest(
                f"request: {size} bytes is over this worker's limit of "
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

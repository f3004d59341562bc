"""The bodies of POST /v1/completions and /v1/chat/completions, as OpenAI documents them:
what exlq honours is typed; what it cannot honour is accepted only at its "off" value
(unsupported.py refuses the rest, naming the parameter)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from exlq.protocol.models import MAX_NEW_TOKENS_LIMIT, MAX_TOP_LOGPROBS

# OpenAI's own bound on n.
MAX_CHOICES = 128
# A seed and its n - 1 successors must stay within the wire's seed range.
MAX_SEED = 2**63 - 1 - MAX_CHOICES


class _Body(BaseModel):
    # A field OpenAI does not define is refused, as OpenAI's own server does ("Unrecognized
    # request argument supplied"): a typo must not pass as a silent default.
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class StreamOptions(_Body):
    include_usage: bool = False
    # Sent by newer clients; exlq's chunks carry no obfuscation padding, which is allowed.
    include_obfuscation: bool | None = None


class _CommonBody(_Body):
    """What both endpoints share."""

    model: Annotated[str, Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] | None = None
    temperature: Annotated[float, Field(ge=0.0, le=2.0)] | None = None
    top_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    frequency_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    presence_penalty: Annotated[float, Field(ge=-2.0, le=2.0)] | None = None
    user: str | None = None
    metadata: dict[str, JsonValue] | None = None
    service_tier: str | None = None
    # exlq's extensions (vLLM accepts the same names): samplers OpenAI's API lacks.
    top_k: Annotated[int, Field(ge=0, le=100_000)] | None = None
    min_p: Annotated[float, Field(ge=0.0, le=1.0)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0.0, le=10.0)] | None = None
    # Structured output, OpenAI's shapes ({type: text | json_object | json_schema}), checked
    # by the wire model (exlq.protocol.models.ResponseFormat). The completions endpoint takes
    # it too, as vLLM's does.
    response_format: dict[str, Any] | None = None
    # exlq's extension (vLLM's guided_regex): a regex the whole output must match.
    regex: str | None = None
    # Accepted at their "off" value only (unsupported.py).
    logit_bias: dict[str, float] | None = None


class CompletionBody(_CommonBody):
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(_Body):
    type: Literal["text"]
    text: str


class ChatMessageBody(_Body):
    # Which roles, parts and fields are allowed is checked in translate.py, so that the 400
    # names the role at fault first (a tool message's tool_call_id is not the point).
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    # Present (and null) in messages some clients echo back from an earlier answer.
    tool_calls: list[dict[str, Any]] | None = None
    refusal: str | None = None


class ChatBody(_CommonBody):
    messages: Annotated[list[ChatMessageBody], Field(min_length=1)]
    max_completion_tokens: Annotated[int, Field(ge=1, le=MAX_NEW_TOKENS_LIMIT)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    # Accepted at their "off" value only (unsupported.py).
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    modalities: list[str] | None = None
    audio: dict[str, Any] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    web_search_options: dict[str, Any] | None = None
    store: bool | None = None
    verbosity: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

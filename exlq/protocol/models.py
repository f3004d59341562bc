"""The wire contract, version 1: pydantic models of requests, events and results."""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    JsonValue,
    SerializerFunctionWrapHandler,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_serializer,
    model_validator,
)
from pydantic_core import to_json

from exlq.protocol.keys import NAME_PATTERN
from exlq.protocol.packed_ids import PackedIds

PROTOCOL_VERSION: Literal[1] = 1
# A request of version 2 asks for its events on the queue's shard channel (keys.QueueKeys.
# shard_events), published with SPUBLISH in the queue's slot: what the SDK sends on a Redis
# Cluster of Redis >= 7. Version 1 (every other case) keeps the job's own channel.
SHARDED_EVENTS_VERSION: Literal[2] = 2
# Hard bounds of the contract. Workers may configure tighter limits.
MAX_NEW_TOKENS_LIMIT = 65_536
MAX_STOP_STRINGS = 16
MAX_TOP_LOGPROBS = 20

FinishReason = Literal["stop", "length", "cancelled", "expired"]
JobState = Literal["queued", "running", "done", "failed", "cancelled", "expired"]
ChatRole = Literal["system", "user", "assistant"]
INPUTS = ("prompt", "messages", "input_ids", "input_ids_b64")


def final_state(reason: FinishReason) -> JobState:
    """The state a job ends in for a finish reason (errors end in "failed")."""
    return "cancelled" if reason == "cancelled" else "expired" if reason == "expired" else "done"


class WireModel(BaseModel):
    """Strict base: unknown fields and type coercions are refused, never guessed at."""

    # allow_inf_nan=False: JSON has no Infinity or NaN; such a value could not round-trip.
    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


class Sampling(WireModel):
    """Sampling settings. The defaults sample from the model's plain distribution."""

    temperature: float = Field(1.0, ge=0.0, le=10.0, description="0 means greedy")
    top_k: int = Field(0, ge=0, le=100_000, description="0 disables top-k")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    typical: float = Field(1.0, gt=0.0, le=1.0, description="1 disables typical sampling")
    repetition_penalty: float = Field(1.0, gt=0.0, le=10.0, description="1 disables it")
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    seed: int | None = Field(None, ge=0, le=2**63 - 1)


class ChatMessage(WireModel):
    role: ChatRole
    content: str


def _all_finite(value: JsonValue) -> bool:
    if isinstance(value, float):
        return math.isfinite(value)
    if isinstance(value, dict):
        return all(_all_finite(v) for v in value.values())
    if isinstance(value, list):
        return all(_all_finite(v) for v in value)
    return True


class TextFormat(WireModel):
    """Plain text: no constraint."""

    type: Literal["text"]


class JsonObjectFormat(WireModel):
    """Any JSON object."""

    type: Literal["json_object"]


class JsonSchemaSpec(WireModel):
    """OpenAI's ``json_schema`` member of response_format: the schema the output must match.
    ``name``, ``description`` and ``strict`` are accepted as OpenAI's clients send them;
    exlq holds every output to the schema whatever ``strict`` says."""

    name: str | None = Field(None, max_length=64)
    description: str | None = None
    # "schema" shadows a (deprecated) BaseModel method: the attribute is schema_, the wire
    # name is schema, both ways (the serializer below).
    schema_: dict[str, JsonValue] = Field(
        alias="schema", description="a JSON Schema (an object); the output must validate"
    )
    strict: bool | None = None

    @field_validator("schema_")
    @classmethod
    def _finite_schema(cls, value: dict[str, JsonValue]) -> dict[str, JsonValue]:
        if not _all_finite(value):
            raise ValueError("the schema must be JSON: no NaN or Infinity")
        return value

    @model_serializer(mode="wrap")
    def _schema_by_its_wire_name(self, handler: SerializerFunctionWrapHandler) -> Any:
        # Written as "schema" by every dump, not only those that ask for aliases: a request
        # dumped without by_alias must still be one a worker accepts.
        data = handler(self)
        if isinstance(data, dict) and "schema_" in data:
            data = {("schema" if key == "schema_" else key): value for key, value in data.items()}
        return data


class JsonSchemaFormat(WireModel):
    """JSON that validates against the given schema."""

    type: Literal["json_schema"]
    json_schema: JsonSchemaSpec


ResponseFormat = Annotated[
    TextFormat | JsonObjectFormat | JsonSchemaFormat, Field(discriminator="type")
]
ConstraintKind = Literal["json_object", "json_schema", "regex"]


class OutputConstraint(NamedTuple):
    """What a request holds its output to, as an engine reads it: the kind and its source
    text (the schema's JSON, the regex; empty for json_object). Plain text, so that the
    protocol needs no grammar library: an engine compiles it."""

    kind: ConstraintKind
    source: str

    @property
    def field(self) -> str:
        """The request field a compile error names."""
        return {
            "json_object": "response_format",
            "json_schema": "response_format.json_schema.schema",
            "regex": "regex",
        }[self.kind]


def new_job_id() -> str:
    """32 random hex digits, from secrets.token_hex: cheaper than uuid4().hex, and paid in
    every submit that names no id."""
    return secrets.token_hex(16)


class GenerationRequest(WireModel):
    """One job, as a producer writes it into field ``job`` of the jobs stream."""

    v: Literal[1, 2] = PROTOCOL_VERSION
    id: Annotated[str, Field(pattern=NAME_PATTERN)] = Field(default_factory=new_job_id)
    prompt: str | None = None
    messages: list[ChatMessage] | None = Field(None, min_length=1)
    input_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, min_length=1)
    input_ids_b64: PackedIds | None = Field(
        None,
        description=(
            "the prompt's token ids packed: base64 (RFC 4648, padded) of little-endian "
            "unsigned 32-bit integers; the same ids as input_ids, read and written as one "
            "string instead of one JSON number each"
        ),
    )
    max_new_tokens: int = Field(256, ge=1, le=MAX_NEW_TOKENS_LIMIT)
    sampling: Sampling = Field(default_factory=Sampling)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    banned_strings: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, max_length=MAX_STOP_STRINGS
    )
    ignore_eos: bool = Field(False, description="keep generating past the end-of-text token")
    logprobs: int = Field(
        0, ge=0, le=MAX_TOP_LOGPROBS, description="top alternatives per token; 0 for none"
    )
    deadline: float | None = Field(
        None, gt=0, description="Unix time in seconds after which the job is not worth running"
    )
    metadata: dict[str, JsonValue] | None = None
    response_format: ResponseFormat | None = Field(
        None,
        description=(
            "OpenAI's shapes: {type: text} (no constraint), {type: json_object} (any JSON "
            "object), {type: json_schema, json_schema: {name, schema, strict, description}}"
        ),
    )
    regex: str | None = Field(
        None, min_length=1, description="a regular expression the whole output must match"
    )

    @property
    def constraint(self) -> OutputConstraint | None:
        """The output's constraint, from response_format or regex; None for plain text."""
        if self.regex is not None:
            return OutputConstraint("regex", self.regex)
        form = self.response_format
        if isinstance(form, JsonSchemaFormat):
            return OutputConstraint("json_schema", to_json(form.json_schema.schema_).decode())
        if isinstance(form, JsonObjectFormat):
            return OutputConstraint("json_object", "")
        return None

    @property
    def prompt_ids(self) -> Sequence[int] | None:
        """The prompt's token ids, from input_ids or input_ids_b64 (then an array of
        unsigned 32-bit ints); None for a prompt or messages."""
        if self.input_ids is not None:
            return self.input_ids
        return None if self.input_ids_b64 is None else self.input_ids_b64.ids

    @property
    def input_field(self) -> str:
        """The name of the field that holds the prompt."""
        return self._inputs_given()[0]

    def _inputs_given(self) -> list[str]:
        return [name for name in INPUTS if getattr(self, name) is not None]

    def past_deadline(self, now: float) -> bool:
        """Whether the job's deadline (if any) has passed at Unix time ``now``."""
        return self.deadline is not None and self.deadline <= now

    @field_validator("v", mode="before")
    @classmethod
    def _integer_version(cls, value: object) -> object:
        # Literal[1, 2] compares by equality, so true and 1.0 would pass for 1.
        if type(value) is not int:
            raise ValueError("v must be the integer 1, or 2 for events on the queue's shard")
        return value

    @field_validator("regex")
    @classmethod
    def _one_constraint(cls, value: str | None, info: ValidationInfo) -> str | None:
        # response_format comes before regex, so it has been read (if it was valid).
        form = info.data.get("response_format")
        if value is not None and form is not None and form.type != "text":
            raise ValueError(
                f"give response_format {form.type} or regex, not both: an output is held "
                "to one constraint"
            )
        return value

    @field_validator("metadata")
    @classmethod
    def _finite_metadata(cls, value: dict[str, JsonValue] | None) -> dict[str, JsonValue] | None:
        if value is not None and not _all_finite(value):
            raise ValueError("metadata must be JSON: no NaN or Infinity")
        return value

    @model_validator(mode="after")
    def _one_input(self) -> GenerationRequest:
        given = self._inputs_given()
        if len(given) != 1:
            raise ValueError(
                "give exactly one of prompt, messages, input_ids or input_ids_b64 "
                f"(got {', '.join(given) if given else 'none'})"
            )
        return self


class Usage(WireModel):
    prompt_tokens: int = Field(ge=0)
    completion_tokens: int = Field(ge=0)
    cached_tokens: int = Field(0, ge=0, description="prompt tokens served from the prefix cache")


class Timings(WireModel):
    """Seconds since the job entered the queue."""

    queued_s: float = Field(description="until a worker started it")
    first_token_s: float | None = Field(description="until its first token, if any")
    total_s: float = Field(description="until it ended")


class TokenLogprob(WireModel):
    token: str
    token_id: int
    logprob: float


class TokenChoices(WireModel):
    """The alternatives considered at one position, most likely first."""

    top: list[TokenLogprob]


class ErrorInfo(WireModel):
    code: str = Field(
        description=(
            "invalid_request | engine_error | too_many_attempts | internal_error | "
            "duplicate_id | lost"
        )
    )
    message: str


class _Event(WireModel):
    v: Literal[1] = PROTOCOL_VERSION
    id: str
    seq: int = Field(ge=0, description="rises by one per event within an attempt")
    attempt: int = Field(1, ge=1)


class TokenEvent(_Event):
    type: Literal["token"] = "token"
    text: str
    token_ids: list[int]
    logprobs: list[TokenChoices] | None = None


def token_event_json(
    job_id: str,
    seq: int,
    attempt: int,
    text: str,
    token_ids: list[int],
    logprobs: list[TokenChoices] | None = None,
) -> str:
    """A TokenEvent's JSON, byte for byte as ``model_dump_json(exclude_none=True)`` writes it,
    for values the worker already holds as the model's types. A worker writes one per job
    per step: without logprobs this writes a dict through pydantic's own JSON writer and
    builds no model, which costs several times the write itself. Tests check that the two
    agree and that this names every field of TokenEvent."""
    if logprobs is not None:
        return TokenEvent.model_construct(
            id=job_id, seq=seq, attempt=attempt, text=text, token_ids=token_ids, logprobs=logprobs
        ).model_dump_json(exclude_none=True)
    return to_json(
        {
            "v": PROTOCOL_VERSION,
            "id": job_id,
            "seq": seq,
            "attempt": attempt,
            "type": "token",
            "text": text,
            "token_ids": token_ids,
        }
    ).decode()


class DoneEvent(_Event):
    type: Literal["done"] = "done"
    finish_reason: FinishReason
    usage: Usage
    timings: Timings


class ErrorEvent(_Event):
    type: Literal["error"] = "error"
    error: ErrorInfo


class RequeuedEvent(_Event):
    """A retry starts the job over: subscribers drop the partial text they hold."""

    type: Literal["requeued"] = "requeued"
    reason: str


Event = Annotated[TokenEvent | DoneEvent | ErrorEvent | RequeuedEvent, Field(discriminator="type")]
EVENT_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)


class JobResult(WireModel):
    """The final record stored under ``result:<id>``."""

    v: Literal[1] = PROTOCOL_VERSION
    id: str
    state: JobState
    text: str = ""
    finish_reason: FinishReason | None = None
    usage: Usage | None = None
    timings: Timings | None = None
    error: ErrorInfo | None = None
    attempts: int = Field(1, ge=0)


def parse_event(raw: str | bytes) -> Event:
    return EVENT_ADAPTER.validate_json(raw)


def parse_request(raw: str | bytes) -> GenerationRequest:
    """Decode a request; raises InvalidRequest with a message that names the fields at fault."""
    try:
        return GenerationRequest.model_validate_json(raw)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


class InvalidRequest(ValueError):
    """A request that can never run as written; the message says what to fix."""


# Fields holding a union tagged by its "type": pydantic puts the tag in an error's location
# after the field's name (response_format.json_object.schema), where the request has none.
_TAGGED_UNIONS = frozenset({"response_format"})


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for err in exc.errors(include_url=False):
        where = ".".join(_request_path(err["loc"])) or "request"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)


def _request_path(loc: tuple[int | str, ...]) -> list[str]:
    path: list[str] = []
    tag_next = False
    for part in loc:
        if tag_next:
            tag_next = False
            continue
        path.append(str(part))
        tag_next = part in _TAGGED_UNIONS
    return path


def json_schemas() -> dict[str, Any]:
    """JSON Schemas of the request, the events and the result, for producers in any language."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "request": GenerationRequest.model_json_schema(),
        "event": EVENT_ADAPTER.json_schema(),
        "result": JobResult.model_json_schema(),
    }

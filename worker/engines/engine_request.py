"""EngineRequest: what an engine reads of a job's request; PackedRequest: the msgspec Struct
in which a request crosses the pipe into an engine process, and the form an engine there
reads it in.

An engine reads a request's input (prompt, messages or token ids), its length, sampling,
stop and logprob fields and its output constraint (response_format or regex, as an
OutputConstraint: a kind and its source text, which the engine compiles), nothing else.
The worker holds each job's request as the validated GenerationRequest, and an engine on a
thread of the worker (EngineLoop) takes it as it is. An engine in a process of its own
gets every job through a pipe, on the critical path of a burst's first token: unpickling a
GenerationRequest and packing its ids into an array was a large share of what the job cost
the engine process before its first step (`docs/PERFORMANCE.md`, "Starting a burst (always
on)"). So the worker packs each request into a PackedRequest, which msgspec writes and reads as a
MessagePack array (array_like: no field names on the wire, and no Python code per field):
its ids go as one MessagePack extension holding the bytes of a uint32 array, decoded
straight into that array, which the engine reads without another copy. A request whose
ids came packed (input_ids_b64) holds them as that array from its validation on: the
worker never turns them into Python ints.

A sampling setting is defined in three places: the wire model
(exlq.protocol.models.Sampling), EngineSampling here (same name and default), and the
engine that reads it.
"""

from __future__ import annotations

import array
import operator
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Protocol, overload

import msgspec

from exlq.protocol.models import ChatMessage, OutputConstraint, Sampling


class EngineSampling(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A request's sampling settings in the engine process: Sampling's fields, in its
    order, with its defaults. All but ``seed`` are what jobs that sample alike share
    (sampling_settings)."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    typical: float = 1.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    seed: int | None = None


# Read by name, in EngineSampling's order: a field added to Sampling and EngineSampling
# crosses without another line here.
_SAMPLING_FIELDS = operator.attrgetter(*EngineSampling.__struct_fields__)
_SETTINGS_FIELDS = operator.attrgetter(
    *(name for name in EngineSampling.__struct_fields__ if name != "seed")
)

# What an engine may find in a request's sampling: the wire model (engines on the worker's
# thread), or the packed form (in an engine process).
SamplingFields = Sampling | EngineSampling
SamplingSettings = tuple[Any, ...]


def engine_sampling(sampling: SamplingFields) -> EngineSampling:
    if isinstance(sampling, EngineSampling):
        return sampling
    return EngineSampling(*_SAMPLING_FIELDS(sampling))


def sampling_settings(sampling: SamplingFields) -> SamplingSettings:
    """A request's sampling settings, its seed aside, in EngineSampling's order: a key that
    jobs sampling alike share."""
    settings: SamplingSettings = _SETTINGS_FIELDS(sampling)
    return settings


class EngineRequest(Protocol):
    """A request as an engine reads it: a GenerationRequest, or a PackedRequest. Exactly
    prompt, messages or prompt_ids is set (the ids of input_ids or input_ids_b64), as
    GenerationRequest validates."""

    @property
    def prompt(self) -> str | None: ...
    @property
    def messages(self) -> Sequence[ChatMessage] | None: ...
    @property
    def prompt_ids(self) -> Sequence[int] | None: ...
    @property
    def max_new_tokens(self) -> int: ...
    @property
    def sampling(self) -> SamplingFields: ...
    @property
    def stop(self) -> Sequence[str]: ...
    @property
    def stop_token_ids(self) -> Sequence[int]: ...
    @property
    def banned_strings(self) -> Sequence[str]: ...
    @property
    def ignore_eos(self) -> bool: ...
    @property
    def logprobs(self) -> int: ...
    @property
    def constraint(self) -> OutputConstraint | None: ...


class WideIds(Sequence[int]):
    """Token ids of which one does not fit in 32 bits, as they came: the engine refuses such
    an id against its vocabulary, whose bounds are far below; packing it must not fail the
    worker. They cross as decimal text (MessagePack holds no integer past 64 bits)."""

    __slots__ = ("ids",)

    def __init__(self, ids: Sequence[int]) -> None:
        self.ids = tuple(ids)

    @overload
    def __getitem__(self, index: int) -> int: ...
    @overload
    def __getitem__(self, index: slice) -> Sequence[int]: ...
    def __getitem__(self, index: int | slice) -> int | Sequence[int]:
        return self.ids[index]

    def __len__(self) -> int:
        return len(self.ids)

    def __iter__(self) -> Iterator[int]:
        return iter(self.ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, WideIds) and other.ids == self.ids

    def __hash__(self) -> int:
        return hash(self.ids)

    def __repr__(self) -> str:
        return f"WideIds({self.ids!r})"


if TYPE_CHECKING:
    PromptIds = array.array[int] | WideIds
else:  # msgspec reads the annotation at run time: what ext_hook made, taken unchecked
    PromptIds = Any


class PackedRequest(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A validated request's engine fields (EngineRequest's, in its order). Its token ids
    are a uint32 array, or WideIds where one does not fit in 32 bits; its messages keep
    their role and content."""

    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    prompt_ids: PromptIds | None
    max_new_tokens: int
    sampling: EngineSampling
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    banned_strings: tuple[str, ...]
    ignore_eos: bool
    logprobs: int
    constraint: OutputConstraint | None


def packed_request(request: EngineRequest) -> PackedRequest:
    """The request as it crosses the pipe into the engine process."""
    messages = request.messages
    ids = request.prompt_ids
    return PackedRequest(
        request.prompt,
        None if messages is None else tuple(messages),
        None if ids is None else _packed_ids(ids),
        request.max_new_tokens,
        engine_sampling(request.sampling),
        tuple(request.stop),
        tuple(request.stop_token_ids),
        tuple(request.banned_strings),
        request.ignore_eos,
        request.logprobs,
        request.constraint,
    )


def _packed_ids(ids: Sequence[int]) -> array.array[int] | WideIds:
    packed = pack_ids(ids)
    return packed if isinstance(packed, array.array) else WideIds(packed)


def pack_ids(ids: Sequence[int]) -> array.array[int] | tuple[int, ...]:
    """Token ids as a uint32 array (kept as they are if they are one already); a tuple if
    one does not fit. array("I", ids) is faster than filling the array from struct.pack's
    bytes, and than array("q", ids)."""
    if isinstance(ids, array.array) and ids.typecode == "I":
        return ids
    try:
        return array.array("I", ids)
    except OverflowError:  # an id past 32 bits
        return tuple(ids)


def _uint32_array(data: bytes | memoryview) -> array.array[int]:
    ids = array.array("I")
    ids.frombytes(data)
    return ids


# The MessagePack extensions of a PackedRequest's ids, and the hooks of msgspec's encoder
# and decoder that write and read them and its messages.
UINT32_IDS = 1
WIDE_IDS = 2


def encode_hook(value: object) -> object:
    """For msgspec's encoder: the values of a PackedRequest it has no form for."""
    if isinstance(value, array.array):
        return msgspec.msgpack.Ext(UINT32_IDS, value.tobytes())
    if isinstance(value, WideIds):
        return msgspec.msgpack.Ext(WIDE_IDS, ",".join(map(str, value.ids)).encode())
    if isinstance(value, ChatMessage):
        return (value.role, value.content)
    raise NotImplementedError(f"no wire form for {type(value).__name__}")


def ext_hook(code: int, data: memoryview) -> object:
    """For msgspec's decoder: the ids a MessagePack extension holds."""
    if code == UINT32_IDS:
        return _uint32_array(data)
    if code == WIDE_IDS:
        return WideIds([int(text) for text in bytes(data).split(b",")])
    raise ValueError(f"unknown MessagePack extension {code}")


def decode_hook(kind: type, value: Any) -> object:
    """For msgspec's decoder: a PackedRequest's messages (validated in the worker)."""
    if kind is ChatMessage:
        role, content = value
        return ChatMessage.model_construct(role=role, content=content)
    raise NotImplementedError(f"no decoding for {kind.__name__}")

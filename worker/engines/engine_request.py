"""EngineRequest: what an engine reads of a job's request; PackedRequest: the form in which
an engine process reads it; WireRequest: the plain tuple in which it crosses the pipe.

An engine reads a request's input (prompt, messages or token ids), its length, sampling,
stop and logprob fields, nothing else. The worker holds each job's request as the
validated GenerationRequest, and an engine on a thread of the worker (EngineLoop) takes it
as it is. An engine in a process of its own gets every job through a pipe, on the critical
path of a burst's first token: there, unpickling a GenerationRequest of 256 ids and packing
its ids into an array took 81 µs of the engine process's time a job on the H100, a third
of what the job cost it before its first step (`docs/PERFORMANCE.md`, "The way in: a
request in the engine process's form"). So the worker encodes each request as a
WireRequest: plain tuples and strings, its ids the bytes of a uint32 array. On the H100's
host, pickling an 8-job offer took 0.8 µs a job and unpickling it 0.8, against 5.7 and
3.1 for the same fields as named tuples with an int64 array, and 8 jobs of 256 ids fit in
one pipe write (`docs/PERFORMANCE.md`, "Requests across the pipe as plain tuples, and
reports read on the event loop"). The engine process decodes it into a PackedRequest
(2.1 µs), whose ids are the uint32 array the engine reads without a copy. A request whose
ids came packed (input_ids_b64) holds them as that array from its validation on: the
worker never turns them into Python ints.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from exlq.protocol.models import ChatMessage, ChatRole


class SamplingFields(Protocol):
    """The sampling settings an engine reads (exlq.protocol.models.Sampling has them all)."""

    @property
    def temperature(self) -> float: ...
    @property
    def top_k(self) -> int: ...
    @property
    def top_p(self) -> float: ...
    @property
    def min_p(self) -> float: ...
    @property
    def typical(self) -> float: ...
    @property
    def repetition_penalty(self) -> float: ...
    @property
    def frequency_penalty(self) -> float: ...
    @property
    def presence_penalty(self) -> float: ...
    @property
    def seed(self) -> int | None: ...


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


SamplingSettings = tuple[float, int, float, float, float, float, float, float]


def sampling_settings(s: SamplingFields) -> SamplingSettings:
    """A request's sampling settings, its seed aside, in PackedSampling's order."""
    return (
        s.temperature,
        s.top_k,
        s.top_p,
        s.min_p,
        s.typical,
        s.repetition_penalty,
        s.frequency_penalty,
        s.presence_penalty,
    )


class PackedSampling(NamedTuple):
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    typical: float
    repetition_penalty: float
    frequency_penalty: float
    presence_penalty: float
    seed: int | None


class PackedRequest(NamedTuple):
    """A validated request's engine fields as tuples; its token ids as a uint32 array (a
    tuple where an id does not fit in 32 bits: the engine refuses such an id with its
    vocabulary's bounds, which are far below)."""

    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    prompt_ids: array.array[int] | tuple[int, ...] | None
    max_new_tokens: int
    sampling: PackedSampling
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    banned_strings: tuple[str, ...]
    ignore_eos: bool
    logprobs: int


# PackedRequest's fields with the sampling settings a plain tuple, messages (role, content)
# pairs and the ids the bytes of a uint32 array (or a tuple of ids, as in PackedRequest).
WireRequest = tuple[
    str | None,
    tuple[tuple[ChatRole, str], ...] | None,
    bytes | tuple[int, ...] | None,
    int,
    tuple[float, int, float, float, float, float, float, float, int | None],
    tuple[str, ...],
    tuple[int, ...],
    tuple[str, ...],
    bool,
    int,
]


def encode_request(request: EngineRequest) -> WireRequest:
    """The request as it crosses the pipe into the engine process."""
    s = request.sampling
    ids = request.prompt_ids
    return (
        request.prompt,
        None if request.messages is None else tuple((m.role, m.content) for m in request.messages),
        None if ids is None else _ids_wire(ids),
        request.max_new_tokens,
        (*sampling_settings(s), s.seed),
        tuple(request.stop),
        tuple(request.stop_token_ids),
        tuple(request.banned_strings),
        request.ignore_eos,
        request.logprobs,
    )


def decode_request(wire: WireRequest) -> PackedRequest:
    """A WireRequest, in the engine process, as the PackedRequest an engine reads."""
    (
        prompt,
        messages,
        ids,
        max_new_tokens,
        sampling,
        stop,
        stop_token_ids,
        banned_strings,
        ignore_eos,
        logprobs,
    ) = wire
    chat = None
    if messages is not None:  # validated in the worker
        chat = tuple(
            ChatMessage.model_construct(role=role, content=text) for role, text in messages
        )
    return PackedRequest(
        prompt,
        chat,
        None if ids is None else _ids_of(ids),
        max_new_tokens,
        PackedSampling(*sampling),
        stop,
        stop_token_ids,
        banned_strings,
        ignore_eos,
        logprobs,
    )


def _ids_wire(ids: Sequence[int]) -> bytes | tuple[int, ...]:
    if isinstance(ids, array.array) and ids.typecode == "I":
        return ids.tobytes()
    try:
        return struct.pack(f"{len(ids)}I", *ids)
    except struct.error:  # an id past 32 bits
        return tuple(ids)


def pack_ids(ids: Sequence[int]) -> array.array[int] | tuple[int, ...]:
    """Token ids as a uint32 array (kept as they are if they are one already); a tuple if
    one does not fit. The array is filled from struct.pack's bytes: for 256 ids that took
    half the time of array("q", ids), which converts and stores one item at a time (7-8 µs
    against 14-15 on the development machine, Python 3.11 and 3.12)."""
    if isinstance(ids, array.array) and ids.typecode == "I":
        return ids
    return _ids_of(_ids_wire(ids))


def _ids_of(wire: bytes | tuple[int, ...]) -> array.array[int] | tuple[int, ...]:
    if isinstance(wire, tuple):
        return wire
    ids = array.array("I")
    ids.frombytes(wire)
    return ids

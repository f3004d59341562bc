"""EngineRequest: what an engine reads of a job's request; PackedRequest: the light form in
which a request crosses into the engine process.

An engine reads a request's input (prompt, messages or token ids), its length, sampling,
stop and logprob fields, nothing else. The worker holds each job's request as the
validated GenerationRequest, and an engine on a thread of the worker (EngineLoop) takes it
as it is. An engine in a process of its own gets every job through a pipe, on the critical
path of a burst's first token: there, unpickling a GenerationRequest of 256 ids and packing
its ids into an array took 81 µs of the engine process's time a job on the H100, a third
of what the job cost it before its first step (`docs/PERFORMANCE.md`, "The way in: a
request in the engine process's form"). So EngineProcess sends a PackedRequest, built in
the worker: plain tuples, its ids packed already as the int64 array the engine wraps in a
tensor without a copy.
"""

from __future__ import annotations

import array
import struct
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from producer.protocol import ChatMessage


class SamplingFields(Protocol):
    """The sampling settings an engine reads (producer.protocol.Sampling has them all)."""

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
    one of prompt, messages and input_ids is set, as GenerationRequest validates."""

    @property
    def prompt(self) -> str | None: ...
    @property
    def messages(self) -> Sequence[ChatMessage] | None: ...
    @property
    def input_ids(self) -> Sequence[int] | None: ...
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
    """A validated request's engine fields as tuples, which pickle and unpickle in a few
    µs; its token ids as an int64 array (a tuple where an id does not fit in 64 bits: the
    engine refuses such an id with its vocabulary's bounds)."""

    prompt: str | None
    messages: tuple[ChatMessage, ...] | None
    input_ids: array.array[int] | tuple[int, ...] | None
    max_new_tokens: int
    sampling: PackedSampling
    stop: tuple[str, ...]
    stop_token_ids: tuple[int, ...]
    banned_strings: tuple[str, ...]
    ignore_eos: bool
    logprobs: int

    @classmethod
    def of(cls, request: EngineRequest) -> PackedRequest:
        if isinstance(request, PackedRequest):
            return request
        s = request.sampling
        return cls(
            request.prompt,
            None if request.messages is None else tuple(request.messages),
            None if request.input_ids is None else pack_ids(request.input_ids),
            request.max_new_tokens,
            PackedSampling(*sampling_settings(s), s.seed),
            tuple(request.stop),
            tuple(request.stop_token_ids),
            tuple(request.banned_strings),
            request.ignore_eos,
            request.logprobs,
        )


def pack_ids(ids: Sequence[int]) -> array.array[int] | tuple[int, ...]:
    """Token ids as an int64 array, as they are packed once; a tuple if one does not fit.
    The array is filled from struct.pack's bytes: for 256 ids that took half the time of
    array("q", ids), which converts and stores one item at a time (7-8 µs against 14-15
    on the development machine, Python 3.11 and 3.12)."""
    if isinstance(ids, array.array) and ids.typecode == "q":
        return ids
    packed = array.array("q")
    try:
        packed.frombytes(struct.pack(f"{len(ids)}q", *ids))
    except struct.error:  # an id past 64 bits
        return tuple(ids)
    return packed

"""Requests cross into the engine process as PackedRequests (msgspec Structs written as
MessagePack arrays), are read there as PackedRequests, and read as they were."""

from __future__ import annotations

import array
import inspect
from collections.abc import Sequence
from typing import Any

import msgspec
import pytest

from exlq.protocol.models import GenerationRequest, OutputConstraint, Sampling
from exlq.protocol.packed_ids import PackedIds
from exlq.worker.command_pipe import decode_command, encode_frame
from exlq.worker.engine_loop import Admit, Offer
from exlq.worker.engine_process import EngineProcess
from exlq.worker.engines.echo.engine import EchoEngine, echo_text
from exlq.worker.engines.engine_request import (
    UINT32_IDS,
    EngineRequest,
    EngineSampling,
    PackedRequest,
    encode_hook,
    engine_sampling,
    pack_ids,
    packed_request,
    sampling_settings,
)
from exlq.worker.settings import WorkerSettings

HEADER_BYTES = 8  # a frame's length, before its command

# What an engine may read of a request (the members of EngineRequest and SamplingFields).
REQUEST_FIELDS = [
    "prompt",
    "messages",
    "prompt_ids",
    "max_new_tokens",
    "sampling",
    "stop",
    "stop_token_ids",
    "banned_strings",
    "ignore_eos",
    "logprobs",
    "constraint",
]
SAMPLING_FIELDS = list(Sampling.model_fields)


def _requests() -> list[GenerationRequest]:
    return [
        GenerationRequest(prompt="Once upon a time", max_new_tokens=7),
        GenerationRequest(
            messages=[
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Say hello"},
            ],
            stop=["\n\n", "END"],
            banned_strings=["sorry"],
            logprobs=3,
            sampling=Sampling(temperature=0.7, top_k=40, top_p=0.9, min_p=0.05, seed=11),
        ),
        GenerationRequest(
            input_ids=[1, 31_999, 2**40, 0],
            max_new_tokens=1,
            stop_token_ids=[2, 7],
            ignore_eos=True,
            sampling=Sampling(
                temperature=0.0,
                repetition_penalty=1.1,
                frequency_penalty=0.5,
                presence_penalty=-0.5,
                typical=0.9,
            ),
        ),
        GenerationRequest(input_ids_b64=PackedIds.from_ids([1, 31_999, 2**32 - 1, 0])),
    ]


def _read(request: EngineRequest) -> dict[str, Any]:
    """Every field an engine reads, sequences as lists, sampling as a dict."""
    out: dict[str, Any] = {}
    for name in REQUEST_FIELDS:
        value = getattr(request, name)
        if name == "sampling":
            value = {f: getattr(value, f) for f in SAMPLING_FIELDS}
        elif isinstance(value, Sequence) and not isinstance(value, str):  # ids: any form
            value = list(value)
        out[name] = value
    return out


def _members(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if isinstance(value, property)]


def _frame(request: EngineRequest) -> bytearray:
    return encode_frame(Offer(1, [("a", packed_request(request))]))


def _crossed(request: EngineRequest) -> PackedRequest:
    """The request as the engine process reads it: packed, framed, decoded."""
    offer = decode_command(_frame(request)[HEADER_BYTES:])
    assert isinstance(offer, Offer)
    return offer.jobs[0][1]


def test_the_packed_form_carries_every_field_an_engine_reads() -> None:
    # A field an engine reads is added to EngineRequest and PackedRequest together.
    assert _members(EngineRequest) == REQUEST_FIELDS
    assert list(PackedRequest.__struct_fields__) == REQUEST_FIELDS
    assert len(msgspec.structs.astuple(packed_request(_requests()[0]))) == len(REQUEST_FIELDS)
    # Every sampling setting of the wire contract, in its order, with its default.
    assert list(EngineSampling.__struct_fields__) == SAMPLING_FIELDS
    assert engine_sampling(Sampling()) == EngineSampling()


@pytest.mark.parametrize(
    "request_", _requests(), ids=["prompt", "messages", "input_ids", "input_ids_b64"]
)
def test_a_request_reads_as_it_was_after_the_pipe(request_: GenerationRequest) -> None:
    crossed = _crossed(request_)
    assert isinstance(crossed, PackedRequest)
    assert _read(crossed) == _read(request_)
    if request_.messages is not None:
        assert [m.model_dump() for m in crossed.messages or []] == [
            m.model_dump() for m in request_.messages
        ]
    assert _read(_crossed(crossed)) == _read(request_)  # a packed request crosses again


@pytest.mark.parametrize(
    "request_", _requests(), ids=["prompt", "messages", "input_ids", "input_ids_b64"]
)
def test_the_wire_form_is_written_without_python_code_per_field(
    request_: GenerationRequest,
) -> None:
    # msgspec writes and reads a PackedRequest in C: Python runs once for its ids (one
    # extension) and once for each chat message, never for a field, where pickling a named
    # tuple, an array or a pydantic model costs µs each way (the worker and the engine
    # process each pay it for every job on a burst's way in).
    calls: list[type] = []

    def counted(value: object) -> object:
        calls.append(type(value))
        return encode_hook(value)

    msgspec.msgpack.Encoder(enc_hook=counted).encode(packed_request(request_))
    assert len(calls) == (request_.prompt_ids is not None) + len(request_.messages or [])


@pytest.mark.parametrize(
    ("constrained", "kind", "source"),
    [
        ({"regex": r"\d{4}-\d{2}-\d{2}"}, "regex", r"\d{4}-\d{2}-\d{2}"),
        ({"response_format": {"type": "json_object"}}, "json_object", ""),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "object", "required": ["a"]}},
                }
            },
            "json_schema",
            '{"type":"object","required":["a"]}',
        ),
        ({"response_format": {"type": "text"}, "regex": "a|b"}, "regex", "a|b"),
        ({"response_format": {"type": "text"}}, None, None),
    ],
)
def test_an_output_constraint_crosses_as_its_kind_and_source(
    constrained: dict[str, Any], kind: str | None, source: str | None
) -> None:
    request = GenerationRequest.model_validate({"prompt": "x", **constrained})
    crossed = _crossed(request)
    expected = None if kind is None else (kind, source)
    assert request.constraint == crossed.constraint == expected
    if expected is not None:  # read back as the NamedTuple, its field name with it
        assert isinstance(crossed.constraint, OutputConstraint)
        assert crossed.constraint.field == request.constraint.field  # type: ignore[union-attr]
    assert _read(_crossed(crossed)) == _read(request)


@pytest.mark.parametrize("field", ["input_ids", "input_ids_b64"])
def test_token_ids_cross_as_uint32_bytes_and_read_as_a_uint32_array(field: str) -> None:
    given = [5, 6, 2**31, 2**32 - 1]
    value = given if field == "input_ids" else PackedIds.from_ids(given).text
    request = GenerationRequest.model_validate({field: value})
    raw = msgspec.msgpack.decode(_frame(request)[HEADER_BYTES:])  # as written, untyped
    ids_wire = raw[2][0][1][2]  # the offer's first job's request's ids
    assert isinstance(ids_wire, msgspec.msgpack.Ext) and ids_wire.code == UINT32_IDS
    assert len(ids_wire.data) == 16
    ids = _crossed(request).prompt_ids
    assert isinstance(ids, array.array) and ids.typecode == "I"
    assert ids.tolist() == given


def test_eight_jobs_of_256_ids_go_in_one_pipe_write() -> None:
    # A frame goes in one write while the pipe has room, and the engine process wakes once
    # for it; a piece's jobs are offered 8 at a time.
    jobs = [(f"job-{i:03}", GenerationRequest(input_ids=[128_000 + i] * 256)) for i in range(8)]
    frame = encode_frame(Offer(1, [(job_id, packed_request(r)) for job_id, r in jobs]))
    assert len(frame) <= 16_384


@pytest.mark.parametrize("ids", [[0], [31999, 0, 7], list(range(2**32 - 300, 2**32))])
def test_token_ids_pack_to_the_same_values(ids: list[int]) -> None:
    packed = pack_ids(ids)
    assert isinstance(packed, array.array) and packed.typecode == "I"
    assert packed.tolist() == ids
    assert pack_ids(packed) is packed  # packed once


@pytest.mark.parametrize("ids", [[3, 2**64 + 5], [2**32], [1, 2**40], [1, -1]])
def test_an_id_too_large_for_32_bits_crosses_as_it_is(ids: list[int]) -> None:
    # The engine refuses it against its vocabulary; packing must not fail the worker.
    assert pack_ids(ids) == tuple(ids)
    if min(ids) >= 0:
        assert list(_crossed(GenerationRequest(input_ids=ids)).prompt_ids or []) == ids


@pytest.mark.parametrize(
    "request_", _requests(), ids=["prompt", "messages", "input_ids", "input_ids_b64"]
)
def test_an_engine_makes_the_same_text_of_either_form(request_: GenerationRequest) -> None:
    assert echo_text(_crossed(request_)) == echo_text(request_)
    engine = EchoEngine(capacity=2, tokens_per_second=1_000_000)
    engine.add("plain", request_)
    engine.add("packed", _crossed(request_))
    texts: dict[str, str] = {"plain": "", "packed": ""}
    while engine.active_jobs:
        for output in engine.step():
            texts[output.job_id] += getattr(output, "text", "")
    assert texts["plain"] == texts["packed"] != ""


def test_the_engine_process_sends_requests_encoded() -> None:
    process = EngineProcess(WorkerSettings.load(engine="echo"))
    sent: list[Any] = []
    process._send = sent.append  # type: ignore[method-assign]
    first, second = _requests()[:2]
    process.offer(1, [("a", first)])
    process.admit(1, [("a", None), ("b", second)])
    process.add_many([("c", first)])
    try:
        assert isinstance(sent[0], Offer) and sent[0].round == 1
        assert sent[0].jobs == [("a", packed_request(first))]
        assert sent[1] == Admit(1, [("a", None), ("b", packed_request(second))])
        assert sent[2] == Admit(None, [("c", packed_request(first))])
    finally:
        for end in (process._commands, process._reports):
            end.close()
        for end in (process._child_commands, process._child_reports):
            end.close()


def test_the_engines_sampler_settings_take_the_sampling_fields_in_their_order() -> None:
    # exllamav2's settings are made (and shared) from sampling_settings(), positionally.
    from exlq.worker.engines.exllamav2.engine import sampler_settings

    fields = EngineSampling.__struct_fields__
    names = list(inspect.signature(sampler_settings).parameters)
    assert names == [name for name in fields if name != "seed"] and "seed" in fields
    sampling = Sampling(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, typical=0.8, seed=4)
    settings = sampling_settings(sampling)
    assert settings == tuple(getattr(sampling, name) for name in names)
    crossed = _crossed(GenerationRequest(prompt="x", sampling=sampling)).sampling
    assert crossed == EngineSampling(*settings, 4)
    assert sampling_settings(crossed) == settings

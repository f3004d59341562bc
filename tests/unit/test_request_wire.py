"""Requests cross into the engine process as plain tuples (WireRequest), are read there as
PackedRequests, and read as they were."""

from __future__ import annotations

import array
import inspect
import pickle
import pickletools
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest, Sampling
from exlq.protocol.packed_ids import PackedIds
from exlq.worker.engine_process import EngineProcess
from exlq.worker.engines.echo.engine import EchoEngine, echo_text
from exlq.worker.engines.engine_request import (
    EngineRequest,
    PackedRequest,
    PackedSampling,
    SamplingFields,
    decode_request,
    encode_request,
    pack_ids,
    sampling_settings,
)
from exlq.worker.settings import WorkerSettings

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
        elif isinstance(value, tuple | list | array.array):
            value = list(value)
        out[name] = value
    return out


def _members(protocol: type) -> list[str]:
    return [name for name, value in vars(protocol).items() if isinstance(value, property)]


def _crossed(request: EngineRequest) -> PackedRequest:
    """The request as the engine process reads it: encoded, through pickle, decoded."""
    wire = pickle.loads(pickle.dumps(encode_request(request), protocol=pickle.HIGHEST_PROTOCOL))
    return decode_request(wire)


def test_the_packed_form_carries_every_field_an_engine_reads() -> None:
    # A field an engine reads is added to EngineRequest, PackedRequest and the wire together.
    assert _members(EngineRequest) == REQUEST_FIELDS
    assert list(PackedRequest._fields) == REQUEST_FIELDS
    assert len(encode_request(_requests()[0])) == len(REQUEST_FIELDS)
    # Every sampling setting of the wire contract, in the protocol and the packed form.
    assert sorted(_members(SamplingFields)) == sorted(SAMPLING_FIELDS)
    assert sorted(PackedSampling._fields) == sorted(SAMPLING_FIELDS)


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
def test_the_wire_form_pickles_without_a_class(request_: GenerationRequest) -> None:
    # Plain tuples, strings and bytes: pickle calls no Python code to write or read them,
    # where a named tuple, an array or a pydantic model costs µs each way (the worker and
    # the engine process each pay it for every job on a burst's way in).
    data = pickle.dumps(encode_request(request_), protocol=pickle.HIGHEST_PROTOCOL)
    opcodes = {op.name for op, _, _ in pickletools.genops(data)}
    assert not opcodes & {"GLOBAL", "STACK_GLOBAL", "REDUCE", "NEWOBJ", "BUILD"}


@pytest.mark.parametrize("field", ["input_ids", "input_ids_b64"])
def test_token_ids_cross_as_uint32_bytes_and_read_as_a_uint32_array(field: str) -> None:
    given = [5, 6, 2**31, 2**32 - 1]
    value = given if field == "input_ids" else PackedIds.from_ids(given).text
    wire = encode_request(GenerationRequest.model_validate({field: value}))
    assert isinstance(wire[2], bytes) and len(wire[2]) == 16
    ids = decode_request(wire).prompt_ids
    assert isinstance(ids, array.array) and ids.typecode == "I"
    assert ids.tolist() == given


def test_eight_jobs_of_256_ids_go_in_one_pipe_write() -> None:
    # multiprocessing writes a message over 16 KiB as two writes (its length, then the
    # data), and the engine process wakes for each; a piece's jobs are offered 8 at a time.
    jobs = [(f"job-{i:03}", GenerationRequest(input_ids=[128_000 + i] * 256)) for i in range(8)]
    message = ("offer", 1, [(job_id, encode_request(r)) for job_id, r in jobs])
    assert len(pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)) <= 16_384


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
    sent: list[tuple[Any, ...]] = []
    process._send = sent.append  # type: ignore[method-assign]
    first, second = _requests()[:2]
    process.offer(1, [("a", first)])
    process.admit(1, [("a", None), ("b", second)])
    process.add_many([("c", first)])
    try:
        assert sent[0][:2] == ("offer", 1)
        assert sent[0][2] == [("a", encode_request(first))]
        assert sent[1] == ("admit", 1, [("a", None), ("b", encode_request(second))])
        assert sent[2] == ("add", [("c", encode_request(first))])
    finally:
        for end in (process._commands, process._reports):
            end.close()
        for end in (process._child_commands, process._child_reports):
            end.close()


def test_the_engines_sampler_settings_take_the_sampling_fields_in_their_order() -> None:
    # exllamav2's settings are made (and shared) from sampling_settings(), positionally.
    from exlq.worker.engines.exllamav2.engine import sampler_settings

    names = list(inspect.signature(sampler_settings).parameters)
    assert names == list(PackedSampling._fields[:-1]) and PackedSampling._fields[-1] == "seed"
    sampling = Sampling(temperature=0.5, top_k=3, top_p=0.9, min_p=0.1, typical=0.8, seed=4)
    settings = sampling_settings(sampling)
    assert settings == tuple(getattr(sampling, name) for name in names)
    assert _crossed(GenerationRequest(prompt="x", sampling=sampling)).sampling == (*settings, 4)

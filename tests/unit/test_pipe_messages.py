"""Every message of the engine process's two pipes, with every field, crosses and reads back
as it was: the worker's commands (Offer, Admit, Cancel, Stop, their requests packed) and the
engine's messages (Ready, Unavailable, StepReport with each kind of output, Stopped)."""

from __future__ import annotations

import array
from typing import Any

import msgspec
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from exlq.protocol.models import (
    MAX_STOP_STRINGS,
    ChatMessage,
    GenerationRequest,
    OutputConstraint,
    Sampling,
    TokenChoices,
    TokenLogprob,
)
from exlq.worker.command_pipe import decode_command, encode_frame
from exlq.worker.engine_loop import Admit, Cancel, Command, Offer, StepReport, Stop
from exlq.worker.engine_process import (
    EngineMessage,
    Ready,
    Stopped,
    Unavailable,
    decode_message,
    encode_message,
)
from exlq.worker.engines.base import CacheUsage, JobEnded, JobErrored, TokenChunk
from exlq.worker.engines.engine_request import (
    EngineSampling,
    PackedRequest,
    WideIds,
    engine_sampling,
    packed_request,
)

MESSAGES = settings(
    max_examples=150,
    deadline=None,
    database=None,  # leave no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow],
)
HEADER_BYTES = 8

texts = st.text(max_size=40)
job_ids = st.text(min_size=1, max_size=40)
floats = st.floats(allow_nan=False)
counts = st.integers(min_value=0, max_value=2**63 - 1)
uint32_ids = st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=300).map(
    lambda ids: array.array("I", ids)
)
wide_ids = st.lists(st.integers(0, 2**70), min_size=1, max_size=20).filter(
    lambda ids: max(ids) >= 2**32
)
messages = st.lists(
    st.builds(
        ChatMessage.model_construct,
        role=st.sampled_from(["system", "user", "assistant"]),
        content=texts,
    ),
    min_size=1,
    max_size=4,
).map(tuple)
samplings = st.builds(
    EngineSampling,
    temperature=floats,
    top_k=counts,
    top_p=floats,
    min_p=floats,
    typical=floats,
    repetition_penalty=floats,
    frequency_penalty=floats,
    presence_penalty=floats,
    seed=st.none() | counts,
)
constraints = st.none() | st.builds(
    OutputConstraint,
    kind=st.sampled_from(["json_object", "json_schema", "regex"]),
    source=texts,
)
strings = st.lists(st.text(min_size=1, max_size=10), max_size=MAX_STOP_STRINGS).map(tuple)


@st.composite
def packed_requests(draw: st.DrawFn) -> PackedRequest:
    given_input = draw(st.sampled_from(["prompt", "messages", "ids", "wide"]))
    ids = None
    if given_input == "ids":
        ids = draw(uint32_ids)
    elif given_input == "wide":
        ids = WideIds(draw(wide_ids))
    return PackedRequest(
        prompt=draw(texts) if given_input == "prompt" else None,
        messages=draw(messages) if given_input == "messages" else None,
        prompt_ids=ids,
        max_new_tokens=draw(st.integers(1, 65_536)),
        sampling=draw(samplings),
        stop=draw(strings),
        stop_token_ids=tuple(draw(st.lists(counts, max_size=MAX_STOP_STRINGS))),
        banned_strings=draw(strings),
        ignore_eos=draw(st.booleans()),
        logprobs=draw(st.integers(0, 20)),
        constraint=draw(constraints),
    )


commands = st.one_of(
    st.builds(Offer, round=counts, jobs=st.lists(st.tuples(job_ids, packed_requests()))),
    st.builds(
        Admit,
        round=st.none() | counts,
        jobs=st.lists(st.tuples(job_ids, st.none() | packed_requests())),
    ),
    st.builds(Cancel, job_id=job_ids),
    st.just(Stop()),
)

logprobs = st.lists(
    st.builds(
        TokenChoices,
        top=st.lists(
            st.builds(TokenLogprob, token=texts, token_id=counts, logprob=st.floats(-1e9, 0.0))
        ),
    ),
    max_size=3,
)
outputs = st.one_of(
    st.builds(
        TokenChunk,
        job_id=job_ids,
        text=texts,
        token_ids=st.lists(counts, max_size=4),
        logprobs=st.none() | logprobs,
    ),
    st.builds(
        JobEnded,
        job_id=job_ids,
        finish_reason=st.sampled_from(["stop", "length", "cancelled", "expired"]),
        prompt_tokens=counts,
        completion_tokens=counts,
        cached_tokens=st.none() | counts,
        draft_tokens=st.none() | counts,
        accepted_draft_tokens=st.none() | counts,
    ),
    st.builds(JobErrored, job_id=job_ids, code=texts, message=texts),
)
reports = st.builds(
    StepReport,
    outputs=st.lists(outputs, max_size=40),
    step_seconds=st.none() | floats,
    active_jobs=counts,
    cache=st.builds(CacheUsage, pages_used=counts, pages_total=counts),
    finished_at=floats,
    fatal=st.none() | texts,
)
engine_messages = st.one_of(
    reports,
    st.builds(
        Ready,
        name=texts,
        capacity=counts,
        info=st.dictionaries(texts, texts, max_size=5),
    ),
    st.builds(Unavailable, reason=texts),
    st.just(Stopped()),
)


@MESSAGES
@given(commands)
def test_every_command_crosses_with_every_field(command: Command) -> None:
    frame = encode_frame(command)
    assert int.from_bytes(frame[:HEADER_BYTES], "big") == len(frame) - HEADER_BYTES
    assert decode_command(frame[HEADER_BYTES:]) == command


@MESSAGES
@given(packed_requests())
def test_a_packed_request_reads_back_in_the_forms_an_engine_reads(request: PackedRequest) -> None:
    crossed = decode_command(encode_frame(Offer(0, [("a", request)]))[HEADER_BYTES:])
    assert isinstance(crossed, Offer)
    read = crossed.jobs[0][1]
    assert read == request
    if request.prompt_ids is not None:
        # uint32 ids as the array an engine reads without a copy; wide ones as they were.
        assert type(read.prompt_ids) is type(request.prompt_ids)
    for message in read.messages or ():
        assert isinstance(message, ChatMessage)


@MESSAGES
@given(engine_messages)
def test_every_engine_message_crosses_with_every_field(message: EngineMessage) -> None:
    assert decode_message(encode_message(message)) == message


@MESSAGES
@given(
    st.builds(
        Sampling,
        temperature=st.floats(0.0, 10.0),
        top_k=st.integers(0, 100_000),
        top_p=st.floats(0.0, 1.0, exclude_min=True),
        min_p=st.floats(0.0, 1.0),
        typical=st.floats(0.0, 1.0, exclude_min=True),
        repetition_penalty=st.floats(0.0, 10.0, exclude_min=True),
        frequency_penalty=st.floats(-2.0, 2.0),
        presence_penalty=st.floats(-2.0, 2.0),
        seed=st.none() | st.integers(0, 2**63 - 1),
    ),
    st.lists(st.integers(0, 2**66), min_size=1, max_size=50),
)
def test_a_validated_request_packs_every_field(sampling: Sampling, ids: list[int]) -> None:
    request = GenerationRequest(input_ids=ids, sampling=sampling, stop=["x"], logprobs=2)
    packed = packed_request(request)
    assert engine_sampling(sampling) == packed.sampling
    assert msgspec.structs.asdict(packed.sampling) == sampling.model_dump()
    assert list(packed.prompt_ids or []) == ids
    read: Any = decode_command(encode_frame(Admit(None, [("j", packed)]))[HEADER_BYTES:])
    assert read.jobs == [("j", packed)]

"""The wire contract refuses what it cannot honour, naming the field at fault."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import (
    EVENT_ADAPTER,
    DoneEvent,
    GenerationRequest,
    InvalidRequest,
    TokenChoices,
    TokenEvent,
    TokenLogprob,
    json_schemas,
    parse_event,
    parse_request,
    token_event_json,
)


def test_minimal_request_gets_defaults_and_an_id() -> None:
    request = parse_request('{"prompt": "hi"}')
    assert request.prompt == "hi"
    assert request.max_new_tokens == 256
    assert len(request.id) == 32
    assert request.sampling.temperature == 1.0


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        ({"prompt": "x", "colour": 1}, "colour"),
        ({"prompt": "x", "max_new_tokens": 0}, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": "12"}, "max_new_tokens"),
        ({"prompt": "x", "sampling": {"temperature": -1}}, "sampling.temperature"),
        ({"prompt": "x", "sampling": {"top_p": 0}}, "sampling.top_p"),
        ({"prompt": "x", "sampling": {"temprature": 0.5}}, "sampling.temprature"),
        ({"prompt": "x", "logprobs": 21}, "logprobs"),
        ({"prompt": "x", "stop": ["s"] * 17}, "stop"),
        ({"prompt": "x", "id": "has space"}, "id"),
        ({"prompt": "x", "id": "{tag}"}, "id"),
        ({"prompt": "x", "v": 3}, "v"),
        ({"prompt": "x", "v": True}, "v"),
        (
            {"prompt": "x", "input_ids": [1]},
            "exactly one of prompt, messages, input_ids or input_ids_b64",
        ),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
    ],
)
def test_bad_requests_name_the_field(payload: dict[str, object], names: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        parse_request(json.dumps(payload))
    assert names in str(caught.value)


def test_events_round_trip_through_json() -> None:
    token = TokenEvent(id="j", seq=0, text="hi", token_ids=[5])
    assert parse_event(token.model_dump_json()) == token
    raw = (
        '{"v":1,"id":"j","seq":1,"attempt":1,"type":"done","finish_reason":"stop",'
        '"usage":{"prompt_tokens":3,"completion_tokens":1},'
        '"timings":{"queued_s":0.1,"first_token_s":0.2,"total_s":0.3}}'
    )
    done = parse_event(raw)
    assert isinstance(done, DoneEvent) and done.usage.cached_tokens == 0


_LOGPROBS = st.lists(
    st.builds(
        TokenChoices,
        top=st.lists(
            st.builds(
                TokenLogprob,
                token=st.text(),
                token_id=st.integers(min_value=0, max_value=2**31),
                logprob=st.floats(max_value=0.0, allow_nan=False, allow_infinity=False),
            ),
            max_size=3,
        ),
    ),
    max_size=3,
)


@given(
    job_id=st.text(min_size=1),
    seq=st.integers(min_value=0, max_value=2**62),
    attempt=st.integers(min_value=1, max_value=2**31),
    text=st.text(),
    token_ids=st.lists(st.integers(min_value=0, max_value=2**62), max_size=8),
    logprobs=st.none() | _LOGPROBS,
)
def test_the_workers_token_event_writer_matches_the_model_byte_for_byte(
    job_id: str,
    seq: int,
    attempt: int,
    text: str,
    token_ids: list[int],
    logprobs: list[TokenChoices] | None,
) -> None:
    # Any text a tokenizer may decode to (quotes, control characters, non-BMP characters)
    # must reach subscribers as the model would write it, and parse back to the same event.
    written = token_event_json(job_id, seq, attempt, text, token_ids, logprobs)
    model = TokenEvent(
        id=job_id, seq=seq, attempt=attempt, text=text, token_ids=token_ids, logprobs=logprobs
    )
    assert written == model.model_dump_json(exclude_none=True)
    assert parse_event(written) == model


def test_the_workers_token_event_writer_names_every_field_of_the_event() -> None:
    # A field added to TokenEvent must be added to token_event_json too: this fails until it
    # is. (With logprobs the writer builds the model, so every field shows there.)
    written = json.loads(token_event_json("j", 0, 1, "hi", [5]))
    assert set(written) | {"logprobs"} == set(TokenEvent.model_fields)


def test_schema_export_covers_request_event_and_result() -> None:
    schemas = json_schemas()
    assert schemas["protocol_version"] == 1
    assert "max_new_tokens" in schemas["request"]["properties"]
    assert schemas["request"]["additionalProperties"] is False
    kinds = {
        d["properties"]["type"]["const"]
        for d in schemas["event"]["$defs"].values()
        if "type" in d.get("properties", {})
    }
    assert kinds == {"token", "done", "error", "requeued"}
    assert EVENT_ADAPTER.json_schema() == schemas["event"]


def test_request_json_from_the_sdk_is_accepted_by_the_worker_decoder() -> None:
    request = GenerationRequest(prompt="p", stop=["\n"], sampling={"seed": 7})  # type: ignore[arg-type]
    assert parse_request(request.model_dump_json(exclude_none=True)) == request


def test_keys_share_one_hash_tag_per_queue() -> None:
    keys = QueueKeys("llama-8b")
    for key in (keys.jobs, keys.dead, keys.workers, keys.job("a"), keys.result("a")):
        assert "{llama-8b}" in key and key.startswith("exlq:")
    assert keys.events("job-1") == "exlq:out:{job-1}"
    with pytest.raises(ValueError, match="queue name"):
        QueueKeys("bad{queue}")


def test_heartbeats_are_live_within_the_stale_time_and_junk_is_never_live() -> None:
    from exlq.protocol.heartbeat import last_seen, live_times

    beats = [json.dumps({"last_seen": 100.0}), json.dumps({"last_seen": 70.0}), b"junk", "[]"]
    assert last_seen(beats[0]) == 100.0 and last_seen(b"junk") == 0.0 and last_seen("[]") == 0.0
    assert live_times(beats, stale_after_s=30, now=110.0) == [100.0]
    assert live_times(beats, stale_after_s=40, now=110.0) == [100.0, 70.0]

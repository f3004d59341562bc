"""The wire contract refuses what it cannot honour, naming the field at fault."""

from __future__ import annotations

import json

import pytest

from producer.keys import QueueKeys
from producer.protocol import (
    EVENT_ADAPTER,
    DoneEvent,
    GenerationRequest,
    InvalidRequest,
    TokenEvent,
    json_schemas,
    parse_event,
    parse_request,
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
        ({"prompt": "x", "v": 2}, "v"),
        ({"prompt": "x", "input_ids": [1]}, "exactly one of prompt, messages or input_ids"),
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

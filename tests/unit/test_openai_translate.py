"""OpenAI bodies into submit()'s fields, and results into OpenAI's bodies: what the live
routes and the Batch API both rely on."""

from __future__ import annotations

from typing import Any

import pytest

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.translate import (
    CHAT,
    COMPLETIONS,
    parse_body,
    response_from_results,
)
from exlq.protocol.models import ErrorInfo, JobResult, Timings, Usage

USER = [{"role": "user", "content": "hi"}]


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "messages": USER, **fields}


def completion(**fields: Any) -> dict[str, Any]:
    return {"model": "m", "prompt": "hi", **fields}


def test_a_chat_body_becomes_one_job_per_choice_seeded_in_turn() -> None:
    parsed = parse_body(
        CHAT,
        chat(
            n=3,
            seed=10,
            temperature=0.5,
            top_p=0.9,
            stop="END",
            max_completion_tokens=7,
            metadata={"k": "v"},
            user="u",
        ),
    )
    assert (parsed.model, parsed.n, parsed.stream, parsed.priority) == (
        "m",
        3,
        False,
        "interactive",
    )
    jobs = parsed.job_fields()
    assert [job["sampling"]["seed"] for job in jobs] == [10, 11, 12]
    assert jobs[0] == {
        "messages": USER,
        "max_new_tokens": 7,
        "sampling": {"temperature": 0.5, "top_p": 0.9, "seed": 10},
        "stop": ["END"],
        "metadata": {"k": "v"},
        "priority": "interactive",
    }


def test_defaults_are_the_wire_defaults_and_flex_is_the_batch_lane() -> None:
    parsed = parse_body(COMPLETIONS, completion(service_tier="flex"))
    assert parsed.job_fields() == [
        {"prompt": "hi", "sampling": {}, "stop": [], "priority": "batch"}
    ]
    assert parsed.service_tier == "flex"
    assert parse_body(COMPLETIONS, completion(service_tier="auto")).priority == "interactive"


@pytest.mark.parametrize(
    ("prompt", "field"),
    [
        ("text", {"prompt": "text"}),
        (["text"], {"prompt": "text"}),
        ([1, 2], {"input_ids": [1, 2]}),
        ([[1, 2]], {"input_ids": [1, 2]}),
    ],
)
def test_a_prompt_is_text_or_token_ids(prompt: Any, field: dict[str, Any]) -> None:
    [job] = parse_body(COMPLETIONS, completion(prompt=prompt)).job_fields()
    assert {k: job[k] for k in field} == field


def test_content_parts_join_and_developer_is_system() -> None:
    messages = [
        {"role": "developer", "content": "rules"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": "c", "name": "bot"},
    ]
    [job] = parse_body(CHAT, chat(messages=messages)).job_fields()
    assert job["messages"] == [
        {"role": "system", "content": "rules"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "c"},
    ]


def test_logprobs_ask_the_wire_for_at_least_one_alternative() -> None:
    parsed = parse_body(CHAT, chat(logprobs=True, top_logprobs=3))
    assert parsed.top_logprobs == 3 and parsed.job_fields()[0]["logprobs"] == 3
    parsed = parse_body(CHAT, chat(logprobs=True))
    assert parsed.top_logprobs == 0 and parsed.job_fields()[0]["logprobs"] == 1
    parsed = parse_body(COMPLETIONS, completion(logprobs=0))
    assert parsed.top_logprobs == 0 and parsed.job_fields()[0]["logprobs"] == 1
    assert parse_body(CHAT, chat(logprobs=False)).top_logprobs is None


PERSON = {
    "type": "json_schema",
    "json_schema": {
        "name": "person",
        "schema": {"type": "object", "properties": {"name": {"type": "string"}}},
        "strict": True,
    },
}


@pytest.mark.parametrize("endpoint", [CHAT, COMPLETIONS])
@pytest.mark.parametrize(
    "constrained",
    [
        {"response_format": PERSON},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "text"}},
        {"regex": r"\d{4}-\d{2}-\d{2}"},
        {"response_format": {"type": "text"}, "regex": "yes|no"},
    ],
)
def test_response_format_and_regex_go_to_every_job_as_given(
    endpoint: str, constrained: dict[str, Any]
) -> None:
    body = chat(n=2, **constrained) if endpoint == CHAT else completion(n=2, **constrained)
    for job in parse_body(endpoint, body).job_fields():
        assert {name: job[name] for name in constrained} == constrained


def test_top_p_zero_is_greedy() -> None:
    [job] = parse_body(COMPLETIONS, completion(top_p=0)).job_fields()
    assert job["sampling"] == {"temperature": 0.0}


def test_stream_options_ask_for_usage() -> None:
    parsed = parse_body(CHAT, chat(stream=True, stream_options={"include_usage": True}))
    assert parsed.stream and parsed.include_usage


@pytest.mark.parametrize(
    ("endpoint", "body", "param"),
    [
        (CHAT, chat(temperature=2.5), "temperature"),
        (CHAT, chat(messages=[{"role": "tool", "content": "x"}]), "messages[0].role"),
        (CHAT, chat(messages=[{"role": "user", "content": None}]), "messages[0].content"),
        (
            CHAT,
            chat(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]),
            "messages[0].content[0]",
        ),
        (CHAT, chat(messages=[{"role": "user", "content": "x", "mood": 1}]), "messages[0].mood"),
        (CHAT, chat(messages=[]), "messages"),
        (CHAT, chat(tools=[{"type": "function"}]), "tools"),
        (CHAT, chat(tool_choice="auto"), "tool_choice"),
        (CHAT, chat(response_format={"type": "json_schema"}), "response_format.json_schema"),
        (CHAT, chat(response_format={"type": "xml"}), "response_format"),
        (
            COMPLETIONS,
            completion(response_format={"type": "json_schema", "json_schema": {"schema": []}}),
            "response_format.json_schema.schema",
        ),
        (COMPLETIONS, completion(regex=""), "regex"),
        (CHAT, chat(regex=3), "regex"),
        (CHAT, chat(regex="a", response_format={"type": "json_object"}), "regex"),
        (CHAT, chat(logit_bias={"1": 5}), "logit_bias"),
        (CHAT, chat(top_logprobs=2), "top_logprobs"),
        (CHAT, chat(max_tokens=3, max_completion_tokens=4), "max_completion_tokens"),
        (CHAT, chat(stream_options={"include_usage": True}), "stream_options"),
        (CHAT, chat(frobnicate=True), "frobnicate"),
        (CHAT, chat(stop=["ok", ""]), "stop"),
        (CHAT, chat(n=0), "n"),
        (CHAT, chat(seed=-1), "seed"),
        (COMPLETIONS, completion(prompt=["a", "b"]), "prompt"),
        (COMPLETIONS, completion(echo=True), "echo"),
        (COMPLETIONS, completion(suffix="after"), "suffix"),
        (COMPLETIONS, completion(best_of=3), "best_of"),
        (COMPLETIONS, completion(logprobs=21), "logprobs"),
        (COMPLETIONS, completion(max_tokens=0), "max_tokens"),
        (COMPLETIONS, {"prompt": "no model"}, "model"),
    ],
)
def test_a_bad_body_is_a_400_naming_the_parameter(
    endpoint: str, body: dict[str, Any], param: str
) -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_body(endpoint, body)
    assert raised.value.status == 400
    assert raised.value.param == param
    assert param in raised.value.message


def test_what_the_wire_refuses_is_a_400_at_once() -> None:
    with pytest.raises(OpenAIError) as raised:
        parse_body(COMPLETIONS, completion(prompt=[3, -1]))
    assert raised.value.status == 400
    assert "input_ids.1" in raised.value.message


def _result(
    text: str, reason: Any, prompt: int, completion_tokens: int, cached: int = 0
) -> JobResult:
    return JobResult(
        id=f"j{completion_tokens}",
        state="done" if reason in ("stop", "length") else reason,
        text=text,
        finish_reason=reason,
        usage=Usage(
            prompt_tokens=prompt, completion_tokens=completion_tokens, cached_tokens=cached
        ),
        timings=Timings(queued_s=0.0, first_token_s=0.1, total_s=0.2),
    )


def test_results_become_a_chat_completion_with_the_prompt_counted_once() -> None:
    parsed = parse_body(CHAT, chat(n=2))
    results = [_result("a", "stop", 5, 1, cached=4), _result("bb", "length", 5, 2)]
    body = response_from_results(parsed, results, "chatcmpl-1", 123)
    assert body["object"] == "chat.completion" and body["created"] == 123
    assert body["choices"] == [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "a", "refusal": None},
            "logprobs": None,
            "finish_reason": "stop",
        },
        {
            "index": 1,
            "message": {"role": "assistant", "content": "bb", "refusal": None},
            "logprobs": None,
            "finish_reason": "length",
        },
    ]
    assert body["usage"] == {
        "prompt_tokens": 5,
        "completion_tokens": 3,
        "total_tokens": 8,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_results_become_a_text_completion_and_a_cancel_reads_as_length() -> None:
    parsed = parse_body(COMPLETIONS, completion())
    body = response_from_results(parsed, [_result("cut", "cancelled", 1, 1)], "cmpl-1", 1)
    assert body["object"] == "text_completion"
    assert body["choices"] == [
        {"index": 0, "text": "cut", "logprobs": None, "finish_reason": "length"}
    ]


@pytest.mark.parametrize(("code", "status"), [("invalid_request", 400), ("engine_error", 500)])
def test_a_failed_result_raises_its_error(code: str, status: int) -> None:
    parsed = parse_body(COMPLETIONS, completion())
    failed = JobResult(id="j", state="failed", error=ErrorInfo(code=code, message="no"))
    with pytest.raises(OpenAIError) as raised:
        response_from_results(parsed, [failed], "cmpl-1", 1)
    assert (raised.value.status, raised.value.code) == (status, code)

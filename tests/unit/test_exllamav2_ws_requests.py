"""exllamav2's infer fields as exlq's submit fields: its server's defaults, its 'off'
values, its stop conditions, and the settings exlq refuses."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from exlq.producer.client import build_request
from exlq.producer.gateways.exllamav2_ws.request_models import (
    InferRequest,
    TrimRequest,
    UnsupportedSetting,
)

BASE: dict[str, Any] = {"action": "infer", "text": "Once upon", "max_new_tokens": 8, "stream": True}


def fields(eos_ids: frozenset[int] = frozenset(), **extra: Any) -> dict[str, Any]:
    return InferRequest.model_validate({**BASE, **extra}).submit_fields(eos_ids)


def test_absent_settings_sample_as_exllamav2s_server_does() -> None:
    submitted = fields()
    assert submitted["sampling"] == {
        "temperature": 0.9,
        "top_k": 100,
        "top_p": 0.8,
        "typical": 1.0,  # exllamav2's default 0 is off
        "min_p": 0.0,
        "repetition_penalty": 1.05,
        "frequency_penalty": 0.0,
        "presence_penalty": 0.0,
    }
    assert submitted["prompt"] == "Once upon"
    assert submitted["max_new_tokens"] == 8
    assert submitted["stop"] == [] and submitted["stop_token_ids"] == []
    assert submitted["ignore_eos"] is False
    build_request(None, submitted)  # exlq's wire takes it


def test_given_settings_map_to_exlq_names() -> None:
    sampling = fields(
        temperature=0.5,
        top_k=40,
        top_p=0.95,
        min_p=0.05,
        typical=0.9,
        rep_pen=1.2,
        freq_pen=0.1,
        pres_pen=-0.2,
    )["sampling"]
    assert sampling == {
        "temperature": 0.5,
        "top_k": 40,
        "top_p": 0.95,
        "typical": 0.9,
        "min_p": 0.05,
        "repetition_penalty": 1.2,
        "frequency_penalty": 0.1,
        "presence_penalty": -0.2,
    }


def test_zero_top_p_and_typical_mean_off() -> None:
    sampling = fields(top_p=0, typical=0.0, top_k=0)["sampling"]
    assert (sampling["top_p"], sampling["typical"], sampling["top_k"]) == (1.0, 1.0, 0)


def test_token_repetition_penalty_is_another_name_for_rep_pen() -> None:
    sampling = fields(token_repetition_penalty=1.3)["sampling"]
    assert sampling["repetition_penalty"] == 1.3


def test_stop_conditions_split_into_strings_and_token_ids() -> None:
    submitted = fields(stop_conditions=["\n\n", 13, "User:"])
    assert submitted["stop"] == ["\n\n", "User:"]
    assert submitted["stop_token_ids"] == [13]
    # exllamav2 takes a single condition where a list is expected.
    assert fields(stop_conditions="###")["stop"] == ["###"]
    assert fields(stop_conditions=2)["stop_token_ids"] == [2]


def test_custom_bos_leads_the_prompt() -> None:
    request = InferRequest.model_validate({**BASE, "customBos": "<s>"})
    assert request.util_text == "<s>Once upon"
    assert request.submit_fields(frozenset())["prompt"] == "<s>Once upon"


def test_banning_the_eos_token_is_ignore_eos() -> None:
    assert fields(frozenset({2}), bann_bann=[2])["ignore_eos"] is True
    assert fields(frozenset({2, 3}), bann_bann=3)["ignore_eos"] is True


@pytest.mark.parametrize(
    ("eos_ids", "banned", "says"),
    [
        (frozenset({2}), [2, 5], "end-of-text ids are [2]"),
        (frozenset(), [2], "--tokenizer"),
    ],
)
def test_other_banned_ids_are_refused(
    eos_ids: frozenset[int], banned: list[int], says: str
) -> None:
    with pytest.raises(UnsupportedSetting, match="bann_bann") as caught:
        fields(eos_ids, bann_bann=banned)
    assert says in str(caught.value)


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"top_a": 0.2}, "top_a"),
        ({"skew": 1.0}, "skew"),
        ({"token_healing": True}, "token_healing"),
    ],
)
def test_settings_exlq_lacks_are_refused_unless_off(extra: dict[str, Any], name: str) -> None:
    with pytest.raises(UnsupportedSetting, match=name):
        fields(**extra)
    off: dict[str, Any] = {name: False if name == "token_healing" else 0}
    fields(frozenset(), **off)


def test_keys_exllamav2_ignores_are_ignored() -> None:
    fields(request_id="r1", response_id=7, tag={"any": "json"}, full_response=True)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        ({"text": None}, "text"),
        ({"max_new_tokens": "8"}, "max_new_tokens"),
        ({"max_new_tokens": 8.5}, "max_new_tokens"),
        ({"stream": 1}, "stream"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop_conditions": [None]}, "stop_conditions"),
        ({"stop_conditions": [True]}, "stop_conditions"),
    ],
)
def test_wrong_types_are_refused(change: dict[str, Any], field: str) -> None:
    with pytest.raises(ValidationError) as caught:
        InferRequest.model_validate({**BASE, **change})
    assert field in str(caught.value)


@pytest.mark.parametrize("missing", ["text", "max_new_tokens", "stream"])
def test_required_fields_are_required(missing: str) -> None:
    request = {k: v for k, v in BASE.items() if k != missing}
    with pytest.raises(ValidationError, match=missing):
        InferRequest.model_validate(request)


def test_trim_length_is_a_count() -> None:
    assert TrimRequest.model_validate({"text": "a", "trimmed_length": 3}).trimmed_length == 3
    with pytest.raises(ValidationError, match="trimmed_length"):
        TrimRequest.model_validate({"text": "a", "trimmed_length": -1})

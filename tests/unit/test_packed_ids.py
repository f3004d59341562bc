"""input_ids_b64: a prompt's token ids as base64 of little-endian uint32, read into the same
ids as input_ids, refused with a message that names the field when it is not whole."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from exlq.producer.client import _with_packed_ids, build_request
from exlq.protocol.models import GenerationRequest, InvalidRequest, json_schemas, parse_request
from exlq.protocol.packed_ids import PackedIds
from exlq.worker.limits import RequestLimits

IDS = [0, 1, 255, 256, 31_999, 128_255, 2**31, 2**32 - 1]


def _little_endian_b64(ids: list[int]) -> str:
    """What a producer in another language writes, built without struct or array."""
    return base64.b64encode(b"".join(i.to_bytes(4, "little") for i in ids)).decode()


def test_packing_writes_little_endian_uint32_in_padded_base64() -> None:
    packed = PackedIds.from_ids(IDS)
    assert packed.text == _little_endian_b64(IDS)
    assert packed.ids.tolist() == IDS
    assert PackedIds.from_ids([7]).text == "BwAAAA=="  # padded, as RFC 4648 writes it


def test_a_request_reads_the_same_ids_from_either_field() -> None:
    listed = parse_request(json.dumps({"input_ids": IDS}))
    packed = parse_request(json.dumps({"input_ids_b64": _little_endian_b64(IDS)}))
    assert list(packed.prompt_ids or []) == list(listed.prompt_ids or []) == IDS
    assert packed.input_field == "input_ids_b64" and listed.input_field == "input_ids"
    assert packed.input_ids is None


def test_a_packed_request_writes_back_the_text_it_was_given() -> None:
    text = _little_endian_b64(IDS)
    request = parse_request(json.dumps({"id": "job-1", "input_ids_b64": text}))
    assert json.loads(request.model_dump_json())["input_ids_b64"] == text
    assert parse_request(request.model_dump_json()) == request


@pytest.mark.parametrize(
    ("value", "says"),
    [
        ("AQAAAA", "not base64"),  # padding missing
        ("AQAA AA==", "not base64"),
        ("AQAAAA==AQAAAA==", "not base64"),  # data after the padding
        (base64.b64encode(b"\x01\x00\x00").decode(), "3 bytes is not a whole number of 32-bit ids"),
        (base64.b64encode(b"\x01" * 9).decode(), "9 bytes is not a whole number"),
        ("", "at least 1 character"),
        (5, "valid string"),
        ([1, 2], "valid string"),
    ],
)
def test_a_bad_packed_field_is_refused_by_name(value: Any, says: str) -> None:
    with pytest.raises(InvalidRequest, match=f"^input_ids_b64: .*{says}"):
        parse_request(json.dumps({"input_ids_b64": value}))


def test_packed_and_listed_ids_together_are_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"exactly one of .* \(got input_ids, input_ids_b64\)"):
        parse_request(json.dumps({"input_ids": [1], "input_ids_b64": _little_endian_b64([1])}))


def test_the_json_schema_says_the_field_is_base64() -> None:
    field = json_schemas()["request"]["properties"]["input_ids_b64"]
    string = next(s for s in field["anyOf"] if s.get("type") == "string")
    assert string["contentEncoding"] == "base64"
    assert "little-endian unsigned 32-bit" in field["description"]


def test_the_sdk_packs_a_list_of_ids_into_the_field() -> None:
    fields = _with_packed_ids({"input_ids": IDS, "max_new_tokens": 3})
    assert set(fields) == {"input_ids_b64", "max_new_tokens"}
    request = build_request(None, fields)
    assert json.loads(request.model_dump_json())["input_ids_b64"] == _little_endian_b64(IDS)


@pytest.mark.parametrize(
    ("ids", "names"),
    [
        ([], "input_ids: List should have at least 1 item"),
        ([3, -1], "input_ids.1: Input should be greater than or equal to 0"),
        ([1.5], "input_ids.0: Input should be a valid integer"),
        ("12", "input_ids: Input should be a valid list"),
    ],
)
def test_ids_the_sdk_cannot_pack_are_refused_as_input_ids(ids: Any, names: str) -> None:
    fields = _with_packed_ids({"input_ids": ids})
    with pytest.raises(InvalidRequest, match=names):
        build_request(None, fields)


def test_an_id_past_32_bits_is_sent_as_a_list() -> None:
    # The wire form holds 32 bits; a larger id goes as input_ids, for the engine to refuse
    # against its vocabulary as it always has.
    fields = _with_packed_ids({"input_ids": [1, 2**32]})
    assert fields == {"input_ids": [1, 2**32]}


def test_a_workers_prompt_limit_counts_packed_ids_and_names_their_field() -> None:
    limits = RequestLimits(
        max_request_bytes=1 << 20,
        max_prompt_chars=4,
        max_messages=8,
        max_metadata_bytes=1024,
        max_new_tokens=256,
    )
    limits.check(parse_request(json.dumps({"input_ids_b64": _little_endian_b64([1, 2, 3, 4])})))
    with pytest.raises(InvalidRequest, match=r"^input_ids_b64: 5 characters \(or tokens\)"):
        limits.check(parse_request(json.dumps({"input_ids_b64": _little_endian_b64([1] * 5)})))


def test_a_request_built_in_python_takes_the_text_or_a_packed_value() -> None:
    text = _little_endian_b64(IDS)
    assert GenerationRequest(input_ids_b64=text).prompt_ids == PackedIds.from_ids(IDS).ids  # type: ignore[arg-type]
    assert GenerationRequest(
        input_ids_b64=PackedIds.from_ids(IDS)
    ).input_ids_b64 == PackedIds.from_text(text)

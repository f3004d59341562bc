"""Property-based tests of the wire decoder: whatever bytes arrive, ``parse_request`` either
returns a request or raises ``InvalidRequest`` with a message naming the field at fault (or
``request``), and ``parse_event`` raises nothing but ``ValueError`` (pydantic's
``ValidationError`` included) on garbage. Valid requests round-trip through their JSON."""

from __future__ import annotations

import base64
import contextlib
import json
import math
import re
import string
import struct
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from exlq.protocol.keys import NAME_PATTERN, check_name
from exlq.protocol.models import (
    MAX_NEW_TOKENS_LIMIT,
    MAX_STOP_STRINGS,
    MAX_TOP_LOGPROBS,
    GenerationRequest,
    InvalidRequest,
    parse_event,
    parse_request,
)

FUZZ = settings(
    max_examples=200,
    deadline=None,
    database=None,  # leave no .hypothesis/ folder in the checkout
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FIELDS = frozenset(GenerationRequest.model_fields)
ID_ALPHABET = string.ascii_letters + string.digits + "._:-"
_ID_RE = re.compile(NAME_PATTERN.removeprefix("^").removesuffix("$"))

# -- valid requests ----------------------------------------------------------------------

job_ids = st.text(ID_ALPHABET, min_size=1, max_size=128)
json_leaves = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20)
)
json_values = st.recursive(
    json_leaves,
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
sampling_dicts = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.floats(0.0, 10.0),
        "top_k": st.integers(0, 100_000),
        "top_p": st.floats(0.0, 1.0, exclude_min=True),
        "min_p": st.floats(0.0, 1.0),
        "typical": st.floats(0.0, 1.0, exclude_min=True),
        "repetition_penalty": st.floats(0.0, 10.0, exclude_min=True),
        "frequency_penalty": st.floats(-2.0, 2.0),
        "presence_penalty": st.floats(-2.0, 2.0),
        "seed": st.none() | st.integers(0, 2**63 - 1),
    },
)
chat_messages = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=40)}
)
inputs = (
    st.fixed_dictionaries({"prompt": st.text(max_size=200)})
    | st.fixed_dictionaries({"messages": st.lists(chat_messages, min_size=1, max_size=4)})
    | st.fixed_dictionaries(
        {"input_ids": st.lists(st.integers(min_value=0), min_size=1, max_size=20)}
    )
    | st.fixed_dictionaries(
        {
            "input_ids_b64": st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=20).map(
                lambda ids: base64.b64encode(struct.pack(f"<{len(ids)}I", *ids)).decode()
            )
        }
    )
)
INPUT_FIELDS = ("prompt", "messages", "input_ids", "input_ids_b64")
token_id_lists = st.lists(st.integers(min_value=0), max_size=MAX_STOP_STRINGS)
string_lists = st.lists(st.text(min_size=1, max_size=10), max_size=MAX_STOP_STRINGS)
options = st.fixed_dictionaries(
    {},
    optional={
        "v": st.sampled_from([1, 2]),
        "id": job_ids,
        "max_new_tokens": st.integers(1, MAX_NEW_TOKENS_LIMIT),
        "sampling": sampling_dicts,
        "stop": string_lists,
        "stop_token_ids": token_id_lists,
        "banned_strings": string_lists,
        "ignore_eos": st.booleans(),
        "logprobs": st.integers(0, MAX_TOP_LOGPROBS),
        "deadline": st.none()
        | st.floats(0.0, exclude_min=True, allow_nan=False, allow_infinity=False),
        "metadata": st.none() | st.dictionaries(st.text(max_size=8), json_values, max_size=4),
    },
)
valid_request_dicts = st.builds(lambda given, more: {**given, **more}, inputs, options)


def _dumps(value: Any, ascii_only: bool = True) -> str:
    return json.dumps(value, ensure_ascii=ascii_only)


# -- arbitrary JSON text, including what json.dumps would never write ----------------------


@dataclass(frozen=True)
class Raw:
    """A JSON fragment written as is: NaN, huge numbers, deep nesting, bad escapes."""

    text: str


@dataclass(frozen=True)
class Obj:
    """An object as a list of pairs, so that keys may repeat."""

    pairs: tuple[tuple[str, Any], ...]


def _nested(depth: int, shape: str) -> Raw:
    if shape == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


raw_fragments = st.one_of(
    st.sampled_from(
        [
            "NaN",
            "-NaN",
            "Infinity",
            "-Infinity",
            "1e400",
            "-1e400",
            "1e-400",
            "-0",
            "-0.0",
            "0x10",
            "01",
            "1.",
            ".5",
            "+1",
            "tru",
            "nul",
            '"\\ud800"',
            '"\\x41"',
            "'s'",
            "[1,]",
            '{"a":1,}',
            "",
            " ",
            "\u00a0",
        ]
    ).map(Raw),
    st.text("0123456789", min_size=1, max_size=6000).map(Raw),  # huge integers
    st.builds(
        lambda sign, digits, exp: Raw(f"{sign}{digits}e{exp}"),
        st.sampled_from(["", "-"]),
        st.text("0123456789", min_size=1, max_size=30),
        st.integers(-1000, 1000),
    ),
    st.builds(_nested, st.integers(1, 5000), st.sampled_from(["list", "object"])),
    st.builds(lambda c, n: Raw(_dumps(c * n)), st.characters(), st.integers(50_000, 100_000)),
)
json_trees = st.recursive(
    json_leaves | raw_fragments | st.floats(),  # st.floats: NaN and infinities too
    lambda inner: (
        st.lists(inner, max_size=5)
        | st.lists(
            st.tuples(st.sampled_from(sorted(FIELDS)) | st.text(max_size=12), inner), max_size=6
        ).map(lambda pairs: Obj(tuple(pairs)))
    ),
    max_leaves=25,
)


def render(tree: Any) -> str:
    if isinstance(tree, Raw):
        return tree.text
    if isinstance(tree, Obj):
        return "{" + ",".join(f"{_dumps(k)}:{render(v)}" for k, v in tree.pairs) + "}"
    if isinstance(tree, list):
        return "[" + ",".join(render(item) for item in tree) + "]"
    return json.dumps(tree)  # writes NaN / Infinity for non-finite floats


def top_keys(tree: Any) -> set[str]:
    if isinstance(tree, Raw) and tree.text.startswith('{"a":'):  # _nested(n, "object")
        return {"a"}
    return {key for key, _ in tree.pairs} if isinstance(tree, Obj) else set()


# -- the properties ----------------------------------------------------------------------


def decode(raw: str | bytes, may_name: set[str] | frozenset[str] = frozenset()) -> Any:
    """parse_request, asserting that it fails only with InvalidRequest whose message starts
    by naming ``request``, a field of the contract, or one of ``may_name`` (the input's keys).
    Returns the request, or the InvalidRequest."""
    try:
        return parse_request(raw)
    except InvalidRequest as exc:
        message = str(exc)
        assert message, "empty InvalidRequest message"
        names = {"request"} | FIELDS | set(may_name)
        assert any(message.startswith((f"{n}: ", f"{n}.")) for n in names), message
        return exc


def names_path(message: str, path: str) -> bool:
    return re.search(rf"(^|; ){re.escape(path)}[.:]", message) is not None


@FUZZ
@given(valid_request_dicts, st.booleans())
def test_valid_requests_decode_faithfully_and_round_trip(
    given_dict: dict[str, Any], ascii_only: bool
) -> None:
    raw = _dumps(given_dict, ascii_only)
    request = parse_request(raw)
    again = parse_request(raw.encode())
    assert again.model_copy(update={"id": request.id}) == request  # a missing id is made anew
    assert request.model_dump(mode="json", exclude_unset=True) == given_dict
    assert parse_request(request.model_dump_json()) == request
    assert parse_request(request.model_dump_json().encode()) == request


@FUZZ
@given(st.binary(max_size=4096))
def test_arbitrary_bytes_are_refused_cleanly(raw: bytes) -> None:
    decode(raw)


@FUZZ
@given(st.text(max_size=2000))
def test_arbitrary_text_is_refused_cleanly(raw: str) -> None:
    decode(raw)
    decode(raw.encode())


@FUZZ
@given(json_trees)
def test_arbitrary_json_values_are_refused_cleanly(tree: Any) -> None:
    raw = render(tree)
    decode(raw, top_keys(tree))
    decode(raw.encode(), top_keys(tree))


@FUZZ
@given(
    valid_request_dicts,
    st.lists(
        st.tuples(st.sampled_from(sorted(FIELDS)) | st.text(max_size=12), json_trees),
        min_size=1,
        max_size=3,
    ),
)
def test_requests_with_arbitrary_values_are_refused_cleanly(
    base: dict[str, Any], replacements: list[tuple[str, Any]]
) -> None:
    tree = Obj((*((k, Raw(_dumps(v))) for k, v in base.items()), *replacements))
    decode(render(tree), top_keys(tree))


# Near-valid requests: one field given a wrong type or an out-of-range value.
not_a_str = st.one_of(
    st.integers(),
    st.booleans(),
    st.floats(),
    st.lists(st.integers(), max_size=2),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)
not_an_int = st.one_of(
    st.text(max_size=5),
    st.booleans(),
    st.floats().filter(lambda f: not f.is_integer()),
    st.lists(st.integers(), max_size=2),
    st.integers().map(float).filter(math.isfinite),
)
not_a_float = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.floats(), max_size=2))
not_a_list = st.one_of(
    st.text(max_size=5),
    st.integers(),
    st.booleans(),
    st.dictionaries(st.text(max_size=3), st.integers(), max_size=2),
)


def outside(low: float, high: float, *, low_ok: bool = True, high_ok: bool = True) -> Any:
    below = st.floats(max_value=low, allow_nan=False).filter(
        lambda f: f < low if low_ok else f <= low
    )
    above = st.floats(min_value=high, allow_nan=False).filter(
        lambda f: f > high if high_ok else f >= high
    )
    return below | above | st.just(math.nan) | not_a_float


def ints_outside(low: int, high: int | None) -> Any:
    below = st.integers(max_value=low - 1)
    return below if high is None else below | st.integers(min_value=high + 1)


MUTATIONS: dict[str, Any] = {
    "v": st.sampled_from([0, 3, -1, "1", None, [1]]),
    "id": st.one_of(
        not_a_str,
        st.just(None),
        st.text(min_size=1).filter(lambda s: not _ID_RE.fullmatch(s)),
        st.text(ID_ALPHABET, min_size=129, max_size=200),
        st.just(""),
    ),
    "prompt": not_a_str,
    "messages": st.one_of(
        not_a_list,
        st.just([]),
        st.lists(not_a_list, min_size=1, max_size=2),
        st.builds(
            lambda r: [{"role": r, "content": "x"}],
            st.text(max_size=8).filter(lambda r: r not in ("system", "user", "assistant")),
        ),
        st.builds(lambda c: [{"role": "user", "content": c}], not_a_str),
        st.just([{"role": "user", "content": "x", "name": "bob"}]),
        st.just([{"role": "user"}]),
    ),
    "input_ids": st.one_of(
        not_a_list,
        st.just([]),
        st.lists(ints_outside(0, None), min_size=1, max_size=3),
        st.lists(not_an_int, min_size=1, max_size=3),
    ),
    "input_ids_b64": st.one_of(
        not_a_str,
        st.just(""),
        # Not base64: a character outside its alphabet, or padding missing or misplaced.
        st.text(min_size=1, max_size=12).filter(
            lambda s: (
                not re.fullmatch(
                    r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{2}==|[A-Za-z0-9+/]{3}=)?", s
                )
            )
        ),
        # Base64 of bytes that are not whole 32-bit ids.
        st.binary(min_size=1, max_size=30)
        .filter(lambda b: len(b) % 4 != 0)
        .map(lambda b: base64.b64encode(b).decode()),
    ),
    "max_new_tokens": ints_outside(1, MAX_NEW_TOKENS_LIMIT) | not_an_int | st.none(),
    "sampling": not_a_list.filter(lambda v: not isinstance(v, dict))
    | st.lists(st.integers(), max_size=2)
    | st.none(),
    "sampling.temperature": outside(0.0, 10.0),
    "sampling.top_k": ints_outside(0, 100_000) | not_an_int,
    "sampling.top_p": outside(0.0, 1.0, low_ok=False),
    "sampling.min_p": outside(0.0, 1.0),
    "sampling.typical": outside(0.0, 1.0, low_ok=False),
    "sampling.repetition_penalty": outside(0.0, 10.0, low_ok=False),
    "sampling.frequency_penalty": outside(-2.0, 2.0),
    "sampling.presence_penalty": outside(-2.0, 2.0),
    "sampling.seed": ints_outside(0, 2**63 - 1) | not_an_int,
    "stop": not_a_list
    | st.lists(st.text(min_size=1, max_size=3), min_size=17, max_size=20)
    | st.just([""])
    | st.lists(not_a_str, min_size=1, max_size=2),
    "stop_token_ids": not_a_list
    | st.lists(st.integers(0, 9), min_size=17, max_size=20)
    | st.lists(ints_outside(0, None), min_size=1, max_size=2),
    "banned_strings": not_a_list | st.just([""]) | st.lists(not_a_str, min_size=1, max_size=2),
    "ignore_eos": st.one_of(st.integers(), st.text(max_size=5), st.floats(), st.none()),
    "logprobs": ints_outside(0, MAX_TOP_LOGPROBS) | not_an_int | st.none(),
    "deadline": st.floats(max_value=0.0, allow_nan=False) | st.just(math.nan) | not_a_float,
    "metadata": not_a_list.filter(lambda v: not isinstance(v, dict)) | st.lists(st.integers()),
}


def set_path(request: dict[str, Any], path: str, value: Any) -> None:
    head, _, rest = path.partition(".")
    if rest:
        request[head] = dict(request.get(head) or {})
        request[head][rest] = value
    else:
        request[head] = value


@FUZZ
@given(valid_request_dicts, st.data())
def test_a_field_of_wrong_type_or_range_is_named(base: dict[str, Any], data: st.DataObject) -> None:
    path = data.draw(st.sampled_from(sorted(MUTATIONS)), label="path")
    value = data.draw(MUTATIONS[path], label="value")
    request = dict(base)
    set_path(request, path, value)
    outcome = decode(_dumps(request))
    assert isinstance(outcome, InvalidRequest), f"{path}={value!r} was accepted"
    assert names_path(str(outcome), path), str(outcome)


@FUZZ
@given(valid_request_dicts, st.text(max_size=20), json_values)
def test_an_unknown_key_is_named(base: dict[str, Any], key: str, value: Any) -> None:
    assume(key not in FIELDS)
    outcome = decode(_dumps({**base, key: value}), {key})
    assert isinstance(outcome, InvalidRequest)
    # An empty key has an empty location, which the message reports as the request's.
    assert names_path(str(outcome), key or "request"), str(outcome)


@FUZZ
@given(valid_request_dicts, st.data())
def test_a_deleted_field_means_its_default_or_a_request_error(
    base: dict[str, Any], data: st.DataObject
) -> None:
    key = data.draw(st.sampled_from(sorted(base)))
    rest = {k: v for k, v in base.items() if k != key}
    outcome = decode(_dumps(rest))
    if key in INPUT_FIELDS:
        assert isinstance(outcome, InvalidRequest)
        assert str(outcome).startswith("request: ") and "exactly one of" in str(outcome)
    else:
        assert isinstance(outcome, GenerationRequest), str(outcome)
        default = GenerationRequest.model_fields[key].get_default(call_default_factory=True)
        if key != "id":
            assert getattr(outcome, key) == default


@FUZZ
@given(valid_request_dicts, st.lists(inputs, min_size=1, max_size=2))
def test_more_than_one_input_is_a_request_error(
    base: dict[str, Any], extra: list[dict[str, Any]]
) -> None:
    merged = {**base}
    for given_input in extra:
        merged.update(given_input)
    assume(sum(k in merged for k in INPUT_FIELDS) > 1)
    outcome = decode(_dumps(merged))
    assert isinstance(outcome, InvalidRequest)
    assert "exactly one of prompt, messages, input_ids or input_ids_b64" in str(outcome)


# -- events ------------------------------------------------------------------------------

event_dicts = st.fixed_dictionaries(
    {"id": job_ids, "seq": st.integers(0, 1000)},
    optional={"v": st.just(1), "attempt": st.integers(1, 5)},
).flatmap(
    lambda base: st.one_of(
        st.fixed_dictionaries(
            {
                "type": st.just("token"),
                "text": st.text(max_size=10),
                "token_ids": st.lists(st.integers(), max_size=3),
            }
        ),
        st.fixed_dictionaries(
            {
                "type": st.just("error"),
                "error": st.fixed_dictionaries(
                    {"code": st.text(max_size=8), "message": st.text(max_size=8)}
                ),
            }
        ),
        st.fixed_dictionaries({"type": st.just("requeued"), "reason": st.text(max_size=8)}),
    ).map(lambda body: {**base, **body})
)


def parse_event_cleanly(raw: str | bytes) -> None:
    with contextlib.suppress(ValueError):  # pydantic.ValidationError is a ValueError
        parse_event(raw)


@FUZZ
@given(st.binary(max_size=2048) | st.text(max_size=2048))
def test_parse_event_on_arbitrary_input_raises_only_value_errors(raw: str | bytes) -> None:
    parse_event_cleanly(raw)


@FUZZ
@given(json_trees)
def test_parse_event_on_arbitrary_json_raises_only_value_errors(tree: Any) -> None:
    parse_event_cleanly(render(tree))


@FUZZ
@given(
    event_dicts, st.text(max_size=12) | st.sampled_from(["type", "seq", "id", "error"]), json_trees
)
def test_parse_event_on_near_valid_events(event: dict[str, Any], key: str, value: Any) -> None:
    assert parse_event(_dumps(event)).model_dump(mode="json", exclude_unset=True) == event
    tree = Obj((*((k, Raw(_dumps(v))) for k, v in event.items()), (key, value)))
    parse_event_cleanly(render(tree))


# -- what these properties found (documented, not fixed here) ----------------------------


@pytest.mark.parametrize("raw_deadline", ["Infinity", "1e400"])
def test_non_finite_deadline_is_refused_or_round_trips(raw_deadline: str) -> None:
    outcome = decode(f'{{"prompt": "x", "deadline": {raw_deadline}}}')
    if isinstance(outcome, GenerationRequest):  # repr: nan == nan is False
        assert repr(parse_request(outcome.model_dump_json())) == repr(outcome)


@pytest.mark.parametrize("raw_value", ["NaN", "Infinity", "-Infinity"])
def test_non_finite_metadata_is_refused_or_round_trips(raw_value: str) -> None:
    outcome = decode(f'{{"prompt": "x", "metadata": {{"a": {raw_value}}}}}')
    if isinstance(outcome, GenerationRequest):  # repr: nan == nan is False
        assert repr(parse_request(outcome.model_dump_json())) == repr(outcome)


@pytest.mark.parametrize("raw_v", ["true", "1.0"])
def test_version_must_be_an_integer(raw_v: str) -> None:
    outcome = decode(f'{{"prompt": "x", "v": {raw_v}}}')
    assert isinstance(outcome, InvalidRequest)
    assert names_path(str(outcome), "v")


@FUZZ
@given(st.text(max_size=140) | job_ids.map(lambda s: s + "\n"))
def test_check_name_agrees_with_the_request_id_pattern(candidate: str) -> None:
    try:
        check_name("job id", candidate)
        name_ok = True
    except ValueError:
        name_ok = False
    request_ok = isinstance(decode(_dumps({"id": candidate, "prompt": "x"})), GenerationRequest)
    assert name_ok == request_ok, repr(candidate)

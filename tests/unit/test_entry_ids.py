"""entry_ids: the ids an entry names at its top level, read from bytes at any depth, and the
refusal of an entry that names two."""

from __future__ import annotations

import json
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from exlq.protocol.models import InvalidRequest
from exlq.worker.entry_ids import answerable_ids, closing_id, refuse_two_ids, top_level_ids

DEEP = 100_000


@pytest.mark.parametrize(
    ("payload", "ids"),
    [
        (b'{"id":"a","prompt":"x"}', ["a"]),
        (b'{ "prompt" : "x" ,\n "id" :\t"a" }', ["a"]),
        (b'{"prompt":"x"}', []),
        # nested too deep for a parser, closed or not
        (b'{"id":"j1","metadata":' + b"[" * DEEP + b"]" * DEEP + b"}", ["j1"]),
        (b'{"id":"j1","metadata":' + b'{"a":' * DEEP + b"1" + b"}" * DEEP + b"}", ["j1"]),
        (b'{"metadata":' + b"[" * DEEP + b"]" * DEEP + b',"id":"last"}', ["last"]),
        (b'{"id":"j1","metadata":' + b"[" * DEEP, ["j1"]),
        # bytes that are not UTF-8, in another string or in the id itself
        (b'{"id":"j2","prompt":"\xff\xfe"}', ["j2"]),
        (b'{"prompt":"\xff\xfe","id":"j2"}', ["j2"]),
        (b'{"id":"j\xff"}', [None]),
        # escaped quotes and backslashes end no string
        (b'{"prompt":"say \\"id\\": \\"x\\"","id":"a"}', ["a"]),
        (b'{"prompt":"a\\\\","id":"b"}', ["b"]),
        (b'{"prompt":"a\\\\\\"id\\":\\"c","id":"b"}', ["b"]),
        (b'{"x\\"id":"a"}', []),
        # "id" inside a nested object or a string does not count, nor do brackets in strings
        (b'{"metadata":{"id":"n"},"id":"a"}', ["a"]),
        (b'{"metadata":[{"id":"n"}],"messages":[{"id":"m"}]}', []),
        (b'[{"id":"a"}]', []),
        (b'{"prompt":"{\\"id\\":\\"x\\"}"}', []),
        (b'{"prompt":"}}]]","id":"a"}', ["a"]),
        (b'{"prompt":"{[","id":"a"}', ["a"]),
        (b'{"stop":["id"],"xid":"x","id_":"y"}', []),
        # the value: escapes read as a parser reads them; not a string is None
        (b'{"id":"\\u0061b"}', ["ab"]),
        (b'{"id":5,"prompt":"x"}', [None]),
        (b'{"id":{"id":"inner"}}', [None]),
        (b'{"id":"\\ud800"}', ["\ud800"]),
        # the key with its letters escaped is the key "id" to a parser
        (b'{"\\u0069d":"a","i\\u0064":"b"}', ["a", "b"]),
        (b'{"\\\\u0069d":"a"}', []),
        # every top-level "id", in order
        (b'{"id":"a","prompt":"x","id":"b"}', ["a", "b"]),
        # what invalid JSON seems to say
        (b'{"id": "bad-json", "prompt": "x", ', ["bad-json"]),
        (b'{"id":"a","prompt":"unterminated', ["a"]),
        (b'{"prompt":"unterminated\\', []),
        (b"", []),
    ],
)
def test_top_level_ids(payload: bytes, ids: list[str | None]) -> None:
    assert top_level_ids(payload) == ids


_SCALARS = st.none() | st.booleans() | st.integers() | st.text(max_size=8)
_TRICKY_TEXT = st.sampled_from(['"id":"x"', "id", "{", "]", "\\", '\\"', '"', ""]) | st.text()
_VALUES = st.recursive(
    _SCALARS | _TRICKY_TEXT,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(st.sampled_from(["id", "x"]) | st.text(max_size=4), inner, max_size=4)
    ),
    max_leaves=20,
)


@settings(deadline=None, database=None)  # leave no .hypothesis/ folder in the checkout
@given(
    pairs=st.lists(st.tuples(st.sampled_from(["id", "prompt", "metadata"]), _VALUES), max_size=6),
    ascii_only=st.booleans(),
)
def test_agrees_with_the_pairs_written(pairs: list[tuple[str, object]], ascii_only: bool) -> None:
    """Whatever an object holds, the scan finds the "id" keys written at its top level."""
    members = [
        f"{json.dumps(key)}:{json.dumps(value, ensure_ascii=ascii_only)}" for key, value in pairs
    ]
    payload = ("{" + ",".join(members) + "}").encode("utf-8", "surrogatepass")
    expected = [value if isinstance(value, str) else None for key, value in pairs if key == "id"]
    assert top_level_ids(payload) == expected


def test_answerable_ids_are_valid_job_ids_once_each() -> None:
    payload = b'{"id":"a b","id":"c","id":5,"id":"c","id":"d"}'
    assert answerable_ids(payload) == ["c", "d"]
    assert answerable_ids(None) == []
    assert answerable_ids(b'{"id":"' + b"x" * 129 + b'"}') == []


def test_two_different_ids_are_refused() -> None:
    with pytest.raises(InvalidRequest, match=r"names 'id' 2 times \('a', 'b'\); a job has one id"):
        refuse_two_ids(b'{"id":"a","prompt":"x","id":"b"}')
    with pytest.raises(InvalidRequest, match=r"2 times \(a non-string, 'a'\)"):
        refuse_two_ids(b'{"id":5,"prompt":"x","id":"a"}')


@pytest.mark.parametrize(
    "payload",
    [
        b'{"id":"a","prompt":"x"}',
        b'{"id":"a","prompt":"x","id":"a"}',  # the same id twice: no doubt which job
        b'{"id":"a","prompt":"x","metadata":{"user":{"id":"u"},"doc":{"id":"d"}}}',
        b'{"id":"a","prompt":"\\"id\\"","stop":["id"]}',
    ],
)
def test_one_id_passes(payload: bytes) -> None:
    refuse_two_ids(payload)


@pytest.mark.parametrize(
    "payload",
    [
        b'{"id":"a","metadata":{"k":' + json.dumps([{"id": "x"}] * 90_000).encode() + b"}}",
        b"{" + b",".join(b'"id":"x%d"' % i for i in range(80_000)) + b"}",
        b'{"metadata":' + json.dumps(["a"] * 200_000).encode() + b',"id":"z"}',
        b'{"id":"j1","prompt":"' + b'\\"' * 500_000 + b'"}',
        b'{"id":"j1","prompt":"' + b"\\" * 1_000_001,
        b'{"id":"j1","metadata":' + b"[" * 500_000 + b"]" * 500_000 + b"}",
    ],
    ids=["nested-ids", "top-level-ids", "small-strings", "escapes", "unterminated", "deep"],
)
def test_a_megabyte_scans_in_linear_time(payload: bytes) -> None:
    """The worst shapes measured take tens of milliseconds a megabyte; a scan that
    backtracked or went quadratic would take minutes. The bound leaves room for slow CI."""
    started = time.perf_counter()
    top_level_ids(payload)
    assert time.perf_counter() - started < 2.0


@pytest.mark.parametrize(
    ("tail", "ids"),
    [
        (b'xxxx", "id": "last-1"}', ["last-1"]),  # the top level's last member
        (b'xxxx", "id" : "last-2" }\n', ["last-2"]),
        (b'x"}, "meta": {"id": "nested"}}', []),  # a nested object's: two closers
        (b'x", "ids": [{"id": "in-a-list"}]}', []),
        (b'"prompt": "a \\"id\\": \\"q\\"}"}', []),  # inside a string
        (b'x", "id": 7}', []),  # not a string
        (b'x", "id": "no spaces allowed"}', []),  # not a job id
        (None, []),
    ],
)
def test_the_id_that_closes_a_document_is_read_from_its_tail(
    tail: bytes | None, ids: list[str]
) -> None:
    assert closing_id(tail) == ids

"""The ids an entry's JSON names at its top level, read without parsing it.

For the entries a parse cannot answer for: one nested too deep for the parser or holding
bytes that are not UTF-8 is refused, yet names an id whose subscriber waits for an answer;
one that names "id" twice parses as its last id, and the first id's subscriber would
wait for ever. A scan by regular expression reads any depth without recursion and takes
bytes as they are, in time linear in the payload: strings are skipped whole (so neither
brackets nor "id" inside a string count), and Python runs once per "id" key only.
"""

from __future__ import annotations

import json
import re

from exlq.protocol.keys import check_name
from exlq.protocol.models import InvalidRequest

# The key "id", also with its letters escaped as a parser reads them (\u0069, \u0064).
_ID_KEY = rb'"(?:i|\\u0069)(?:d|\\u0064)"\s*+:'
# From a place between two tokens: everything up to the next key "id" (other strings
# skipped whole), the key, and its value where that is a string. Matched at a position
# (never searched for), so each match starts where a token starts. Possessive throughout,
# so that no input makes the engine backtrack.
_TO_NEXT_ID = re.compile(
    rb'[^"]*+(?:(?!' + _ID_KEY + rb')"[^"]*+"[^"]*+)*+'
    rb"(?P<key>" + _ID_KEY + rb')\s*+(?P<value>"[^"]*+")?'
)


def top_level_ids(payload: bytes) -> list[str | None]:
    """The value of each "id" key of the payload's top-level object, in order: the string,
    or None where the value is not a string or cannot be read as one. Invalid JSON gives
    what its tokens seem to say; the caller decides what an id is worth."""
    tokens = _unescaped(payload)
    values: list[str | None] = []
    depth = 0
    pos = 0
    while (found := _TO_NEXT_ID.match(tokens, pos)) is not None:
        # Brackets inside strings are not structure: what lies between the quotes goes
        # (the stretch starts between tokens, so every other piece is a string).
        between = b"".join(tokens[pos : found.start("key")].split(b'"')[::2])
        depth += between.count(b"{") + between.count(b"[")
        depth -= between.count(b"}") + between.count(b"]")
        if depth == 1:
            value = found.span("value")
            values.append(None if value[0] < 0 else _string(payload[value[0] : value[1]]))
        pos = found.end()
    return values


def answerable_ids(payload: bytes | None) -> list[str]:
    """The distinct ids at the payload's top level that are valid job ids, in order: every
    one whose channel may have a subscriber waiting for this entry's answer."""
    named = (value for value in top_level_ids(payload or b"") if value is not None)
    return list(dict.fromkeys(value for value in named if _is_job_id(value)))


# The id as the last member of the top-level object: the value, then the one brace that
# closes the document. A nested object's last member is followed by more than one closer,
# and a string cannot end the document with a brace.
_LAST_ID = re.compile(_ID_KEY + rb'\s*+(?P<value>"[^"\\]*+")\s*+\}\s*+\Z')


def closing_id(tail: bytes | None) -> list[str]:
    """The id a document's last bytes name as its top-level object's last member, if any:
    for an entry read only in part (over the size limit), whose producer wrote the id
    last."""
    found = _LAST_ID.search(tail or b"")
    value = _string(found.group("value")) if found else None
    return [value] if value is not None and _is_job_id(value) else []


def refuse_two_ids(payload: bytes) -> None:
    """Refuse a payload whose top level names "id" more than once, with different values: a
    parser keeps the last, and a subscriber of the first would never hear of the job. Only
    a payload holding "id" twice is scanned: the count is one pass in C, and a full
    second parse of every request would cost more than the first."""
    if payload.count(b'"id"') < 2:
        return
    values = top_level_ids(payload)
    if len(set(values)) > 1:
        named = ", ".join("a non-string" if v is None else repr(v) for v in values)
        raise InvalidRequest(
            f"request: the JSON names 'id' {len(values)} times ({named}); a job has one id"
        )


def _unescaped(payload: bytes) -> bytes:
    """The payload with every escaped backslash and escaped quote blanked, byte for byte
    (positions stay), so that a string's end is its next quote: a regular expression finds
    that in C many times faster than it steps through escapes. Escapes run left to right,
    so pairing backslashes from the left of each run reads them as a parser does."""
    if b"\\" not in payload:
        return payload
    return payload.replace(b"\\\\", b"__").replace(b'\\"', b"__")


def _is_job_id(value: str) -> bool:
    try:
        check_name("job id", value)
    except ValueError:
        return False
    return True


def _string(token: bytes) -> str | None:
    """A string token's value; None where it has none (not UTF-8, a bad escape)."""
    try:
        if b"\\" not in token:
            return token[1:-1].decode()
        value = json.loads(token)  # one string: no depth to fear
    except ValueError:
        return None
    return value if isinstance(value, str) else None

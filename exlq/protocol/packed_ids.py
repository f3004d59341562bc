"""PackedIds: a prompt's token ids as input_ids_b64 carries them on the wire, base64 of
little-endian unsigned 32-bit integers, one string where input_ids writes one JSON number an
id. The SDK packs a list of ids once; a worker decodes the string once into an array and
never makes a Python int of an id (docs/PERFORMANCE.md, "The way back, and Redis (always
on)")."""

from __future__ import annotations

import array
import binascii
import struct
import sys
from collections.abc import Sequence
from typing import Any

from pydantic import GetCoreSchemaHandler, GetJsonSchemaHandler
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import core_schema

# array("I") holds C unsigned ints: 4 bytes on every platform exlq runs on.
assert array.array("I").itemsize == 4, "exlq needs 4-byte unsigned ints for token ids"
MAX_TOKEN_ID = 2**32 - 1


class PackedIds:
    """input_ids_b64's value: ``text``, the base64 as written, and ``ids``, its ids as an
    array of unsigned 32-bit ints (array typecode "I"). Validated from a string; written
    back as that same string."""

    __slots__ = ("ids", "text")

    def __init__(self, text: str, ids: array.array[int]) -> None:
        self.text = text
        self.ids = ids

    @classmethod
    def from_text(cls, text: str) -> PackedIds:
        """Decode input_ids_b64's string. Raises ValueError that says what to fix: not
        base64, or bytes that are not whole 32-bit ids."""
        try:
            packed = binascii.a2b_base64(text, strict_mode=True)
        except (binascii.Error, ValueError):
            raise ValueError(
                "not base64: give the ids as little-endian unsigned 32-bit integers, "
                "base64-encoded with padding (RFC 4648)"
            ) from None
        if not packed or len(packed) % 4:
            raise ValueError(
                f"{len(packed)} bytes is not a whole number of 32-bit ids "
                "(4 bytes each, little-endian)"
            )
        return cls(text, _uint32_array(packed))

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> PackedIds:
        """Pack a sequence of ids. Raises ValueError for no ids or an id that is not an int
        from 0 to 2**32 - 1 (a bool packs as 0 or 1, as Python's ints do). This costs less
        than validating the same ids as input_ids."""
        if not ids:
            raise ValueError("give at least one id")
        try:
            packed = struct.pack(f"<{len(ids)}I", *ids)
        except struct.error:
            raise ValueError(f"every id must be an integer from 0 to {MAX_TOKEN_ID}") from None
        return cls(
            binascii.b2a_base64(packed, newline=False).decode("ascii"), _uint32_array(packed)
        )

    def __eq__(self, other: object) -> bool:
        return isinstance(other, PackedIds) and other.text == self.text

    def __hash__(self) -> int:
        return hash(self.text)

    def __repr__(self) -> str:
        return f"PackedIds({len(self.ids)} ids)"

    @classmethod
    def __get_pydantic_core_schema__(
        cls, source: Any, handler: GetCoreSchemaHandler
    ) -> core_schema.CoreSchema:
        from_text = core_schema.no_info_after_validator_function(
            cls.from_text, core_schema.str_schema(min_length=1, strict=True)
        )
        return core_schema.json_or_python_schema(
            json_schema=from_text,
            python_schema=core_schema.no_info_plain_validator_function(cls._from_python),
            serialization=core_schema.plain_serializer_function_ser_schema(
                _text_of, return_schema=core_schema.str_schema()
            ),
        )

    @classmethod
    def _from_python(cls, value: object) -> PackedIds:
        if isinstance(value, PackedIds):
            return value  # the SDK's, packed from a list
        if not isinstance(value, str) or not value:
            raise ValueError("give a non-empty string (or a PackedIds)")
        return cls.from_text(value)

    @classmethod
    def __get_pydantic_json_schema__(
        cls, schema: core_schema.CoreSchema, handler: GetJsonSchemaHandler
    ) -> JsonSchemaValue:
        return {"type": "string", "minLength": 1, "contentEncoding": "base64"}


def _text_of(value: PackedIds) -> str:
    return value.text


def _uint32_array(packed: bytes) -> array.array[int]:
    ids = array.array("I")
    ids.frombytes(packed)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids

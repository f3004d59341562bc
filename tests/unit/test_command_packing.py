"""Commands packed in C are the bytes redis-py's own packer writes, and a connection that
does not encode as strict UTF-8 keeps redis-py's packer."""

from __future__ import annotations

from typing import Any

import hiredis
import pytest
import redis.connection
from redis.asyncio.connection import (
    Connection,
    SSLConnection,
    UnixDomainSocketConnection,
)
from redis.exceptions import DataError
from redis.typing import EncodableT

from exlq.protocol import command_packing
from exlq.protocol.command_packing import packed_in_c

COMMANDS: list[tuple[EncodableT, ...]] = [
    ("SET", "key", "plain"),
    ("SET", "key", "é ✓ 漢字"),  # text beyond ASCII, as UTF-8
    ("SET", b"key", b"\x00\xff raw bytes"),
    ("SET", "key", memoryview(b"a view")),
    ("SET", "key", -3),
    ("SET", "key", 10**20),
    ("SET", "key", 1.5),
    ("SET", "key", 1e-300),
    ("SET", "key", float("inf")),
    ("CONFIG GET", "maxmemory"),  # a command name of two words is split, as redis-py does
    ("EVALSHA", "a" * 40, 2, "k1", "k2", 86400, "", "x" * 70_000),  # past redis-py's cutoff
]


def _bytes(chunks: list[bytes] | list[bytes | memoryview]) -> bytes:
    return b"".join(bytes(chunk) for chunk in chunks)


@pytest.mark.parametrize("args", COMMANDS, ids=lambda args: repr(args)[:40])
def test_a_command_packed_in_c_is_the_bytes_redis_py_packs(args: tuple[EncodableT, ...]) -> None:
    in_python = Connection()
    in_c = packed_in_c(Connection)()
    assert _bytes(in_c.pack_command(*args)) == _bytes(in_python.pack_command(*args))


def test_several_commands_packed_together_are_the_bytes_redis_py_packs() -> None:
    commands = [("SUBSCRIBE", *(f"exlq:out:{{{i}}}" for i in range(40))), COMMANDS[-1]]
    packed = packed_in_c(Connection)().pack_commands(commands)
    assert _bytes(packed) == _bytes(Connection().pack_commands(commands))


@pytest.mark.parametrize("bad", [True, None, {"a": 1}])
def test_a_value_redis_cannot_take_raises_redis_pys_data_error(bad: object) -> None:
    with pytest.raises(DataError):
        packed_in_c(Connection)().pack_command("SET", "key", bad)  # type: ignore[arg-type]


def test_text_that_is_not_valid_unicode_raises_as_with_redis_py() -> None:
    with pytest.raises(UnicodeEncodeError):
        packed_in_c(Connection)().pack_command("SET", "key", "\ud800")


@pytest.mark.parametrize("encoding", ["latin-1", "utf-16"])
def test_a_connection_that_encodes_otherwise_keeps_redis_pys_packer(encoding: str) -> None:
    args = ("SET", "key", "café")
    in_c = packed_in_c(Connection)(encoding=encoding)
    expected = Connection(encoding=encoding).pack_command(*args)
    assert _bytes(in_c.pack_command(*args)) == _bytes(expected)
    assert _bytes(expected) != _bytes(Connection().pack_command(*args))  # it did differ


def test_utf8_with_errors_replaced_keeps_redis_pys_packer() -> None:
    args = ("SET", "key", "\ud800")
    in_c = packed_in_c(Connection)(encoding_errors="replace")
    assert _bytes(in_c.pack_command(*args)) == _bytes(
        Connection(encoding_errors="replace").pack_command(*args)
    )


@pytest.mark.parametrize("kind", [Connection, SSLConnection, UnixDomainSocketConnection])
def test_each_connection_kind_keeps_its_own_transport_and_is_made_once(
    kind: type[Connection],
) -> None:
    made = packed_in_c(kind)
    assert issubclass(made, kind)
    assert packed_in_c(kind) is made
    assert packed_in_c(made) is made  # packing twice is packing once


# -- where hiredis's packer is missing or differs: redis-py's own, unchanged -------------


def test_without_redis_pys_hiredis_serializer_commands_pack_in_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(redis.connection, "HiredisRespSerializer")
    packer, why = command_packing.find_c_packer()
    assert packer is None
    assert "HiredisRespSerializer" in why


def test_a_hiredis_that_cannot_pack_is_not_used(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delattr(hiredis, "pack_command")
    packer, why = command_packing.find_c_packer()
    assert packer is None
    assert "cannot pack commands" in why


class _RefusesViews:
    """Packs as redis-py 5.0's serializer did: a memoryview is refused."""

    def pack(self, *args: Any) -> list[bytes]:
        if any(isinstance(arg, memoryview) for arg in args):
            raise DataError("memoryview")
        return list(Connection().pack_command(*args))


class _PacksOtherwise:
    def pack(self, *args: Any) -> list[bytes]:
        return [b"*1\r\n$4\r\nPING\r\n"]


@pytest.mark.parametrize(
    ("serializer", "why"), [(_RefusesViews, "failed"), (_PacksOtherwise, "otherwise")]
)
def test_a_packer_that_fails_or_differs_on_a_sample_is_not_used(
    monkeypatch: pytest.MonkeyPatch, serializer: type[Any], why: str
) -> None:
    monkeypatch.setattr(redis.connection, "HiredisRespSerializer", serializer)
    packer, reason = command_packing.find_c_packer()
    assert packer is None
    assert why in reason


def test_without_a_c_packer_connection_classes_stay_redis_pys(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(command_packing, "_PACKER", None)
    assert packed_in_c(SSLConnection) is SSLConnection
    # A class made while the packer was there packs in Python once it is gone.
    made = packed_in_c(Connection)
    args = ("SET", "key", "é")
    assert _bytes(made().pack_command(*args)) == _bytes(Connection().pack_command(*args))

"""Redis commands packed in C, on redis-py's asyncio connections.

redis-py's synchronous connections pack each command with hiredis's C packer when hiredis
is installed (a dependency of exlq). Its asyncio connections always pack in Python: each
argument is encoded, and the command's bytes are joined piece by piece. On the development
machine a piece of 32 submits (its SUBSCRIBE and its script, 256-token prompts) took
387 µs to pack in Python against 64 µs in C; a worker's start script for 8 jobs 85 against
27 µs. ``packed_in_c`` gives a connection class whose commands hiredis packs, byte for
byte as redis-py would (its own ``HiredisRespSerializer``, which the tests compare).

Only a connection that encodes text as strict UTF-8 (redis-py's default) packs in C;
hiredis knows no other encoding, so any other keeps redis-py's packer.
"""

from __future__ import annotations

import codecs
from typing import Any, TypeVar, cast

from redis.asyncio.connection import AbstractConnection, ConnectionPool
from redis.connection import HiredisRespSerializer
from redis.typing import EncodableT

_PACKER = HiredisRespSerializer()
_UTF8 = codecs.lookup("utf-8").name

ConnectionT = TypeVar("ConnectionT", bound=AbstractConnection)
_made: dict[type[Any], type[Any]] = {}


def _encodes_utf8(connection: AbstractConnection) -> bool:
    encoder = connection.encoder
    return codecs.lookup(encoder.encoding).name == _UTF8 and encoder.encoding_errors == "strict"


def packed_in_c(connection_class: type[ConnectionT]) -> type[ConnectionT]:
    """``connection_class`` (plain, TLS or Unix socket) with its commands packed in C; one
    class per class given, and a class so made is returned as it is."""
    if issubclass(connection_class, _PackedInC):
        return connection_class
    made = _made.get(connection_class)
    if made is None:
        name = f"{connection_class.__name__}PackedInC"
        made = _made[connection_class] = type(name, (_PackedInC, connection_class), {})
    return cast("type[ConnectionT]", made)


def pack_in_c(pool: ConnectionPool) -> None:
    """Make the connections ``pool`` opens from now on pack their commands in C."""
    pool.connection_class = packed_in_c(pool.connection_class)


class _PackedInC(AbstractConnection):
    """Put before a connection class: its ``pack_command``, which ``pack_commands`` and every
    command sent call, packs in C."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        if not _encodes_utf8(self):
            return super().pack_command(*args)
        return cast("list[bytes]", _PACKER.pack(*cast("list[Any]", args)))

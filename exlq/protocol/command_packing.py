"""Redis commands packed in C, on redis-py's asyncio connections.

redis-py's synchronous connections pack each command with hiredis's C packer when hiredis
is installed (a dependency of exlq). Its asyncio connections always pack in Python: each
argument is encoded, and the command's bytes are joined piece by piece. A burst's submits
and a worker's start scripts carry hundreds of arguments, so packing them in Python costs
several times what C does, on the way to a burst's first step. ``packed_in_c`` gives a
connection class whose commands hiredis packs, byte for byte as redis-py would (its own
``HiredisRespSerializer``, which the tests compare).

Only a connection that encodes text as strict UTF-8 (redis-py's default) packs in C;
hiredis knows no other encoding, so any other keeps redis-py's packer.

``HiredisRespSerializer`` is not part of redis-py's documented API, and hiredis packs only
from 2.1 on. At import, the packer is tried on sample commands against redis-py's own
asyncio packer: where it is missing, raises, or writes other bytes (older redis-py gives
hiredis a memoryview it refuses), connections keep redis-py's packer (slower, the same
commands) and a debug line says why.
"""

from __future__ import annotations

import codecs
import logging
from typing import Any, Protocol, TypeVar, cast

from redis.asyncio.connection import AbstractConnection, Connection, ConnectionPool
from redis.typing import EncodableT

log = logging.getLogger(__name__)

_UTF8 = codecs.lookup("utf-8").name

# Every kind of value exlq's commands carry, and those where packers have differed.
PROBE_COMMANDS: tuple[tuple[EncodableT, ...], ...] = (
    ("SET", "key", "é ✓ 漢字"),
    ("SET", b"key", b"\x00\xff raw bytes"),
    ("SET", "key", memoryview(b"a view")),
    ("SET", "key", -3),
    ("SET", "key", 10**20),
    ("SET", "key", 1.5),
    ("SET", "key", 1e-300),
    ("CONFIG GET", "maxmemory"),
    ("EVALSHA", "a" * 40, 2, "k1", "k2", 86400, "", "x" * 70_000),
)


class _Packer(Protocol):
    def pack(self, *args: Any) -> Any: ...


ConnectionT = TypeVar("ConnectionT", bound=AbstractConnection)
_made: dict[type[Any], type[Any]] = {}


def _joined(chunks: Any) -> bytes:
    return b"".join(bytes(chunk) for chunk in chunks)


def find_c_packer() -> tuple[_Packer | None, str]:
    """redis-py's hiredis packer where it packs the probe commands as redis-py's asyncio
    connections do; else None and why not."""
    try:
        import hiredis
        from redis.connection import HiredisRespSerializer
    except ImportError as exc:
        return None, f"hiredis, or redis-py's HiredisRespSerializer, is missing ({exc})"
    if not hasattr(hiredis, "pack_command"):
        return None, f"hiredis {hiredis.__version__} cannot pack commands (2.1 and later can)"
    packer = HiredisRespSerializer()
    in_python = Connection()
    for args in PROBE_COMMANDS:
        try:
            packed = packer.pack(*cast("list[Any]", args))
            same = _joined(packed) == _joined(in_python.pack_command(*args))
        except Exception as exc:  # any failure here means: not this packer
            return None, f"hiredis failed to pack {args[0]!r} ({exc!r})"
        if not same:
            return None, f"hiredis packs {args[0]!r} otherwise than redis-py"
    return packer, "hiredis"


_PACKER, _WHY = find_c_packer()
if _PACKER is None:
    log.debug("commands are packed by redis-py in Python, not in C: %s", _WHY)


def packs_in_c() -> bool:
    """Whether ``packed_in_c`` gives connections that pack in C in this install."""
    return _PACKER is not None


def _encodes_utf8(connection: AbstractConnection) -> bool:
    encoder = connection.encoder
    return codecs.lookup(encoder.encoding).name == _UTF8 and encoder.encoding_errors == "strict"


def packed_in_c(connection_class: type[ConnectionT]) -> type[ConnectionT]:
    """``connection_class`` (plain, TLS or Unix socket) with its commands packed in C; one
    class per class given, and a class so made is returned as it is. Where hiredis cannot
    pack here, ``connection_class`` itself."""
    if _PACKER is None or issubclass(connection_class, _PackedInC):
        return connection_class
    made = _made.get(connection_class)
    if made is None:
        name = f"{connection_class.__name__}PackedInC"
        made = _made[connection_class] = type(name, (_PackedInC, connection_class), {})
    return cast("type[ConnectionT]", made)


def pack_in_c(pool: ConnectionPool) -> None:
    """Make the connections ``pool`` opens from now on pack their commands in C (where
    hiredis can pack here)."""
    pool.connection_class = packed_in_c(pool.connection_class)


class _PackedInC(AbstractConnection):
    """Put before a connection class: its ``pack_command``, which ``pack_commands`` and every
    command sent call, packs in C."""

    def pack_command(self, *args: EncodableT) -> list[bytes]:
        packer = _PACKER
        if packer is None or not _encodes_utf8(self):
            return super().pack_command(*args)
        return cast("list[bytes]", packer.pack(*cast("list[Any]", args)))

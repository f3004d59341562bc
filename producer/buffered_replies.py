"""The replies a connection has already read, taken without a `read_response()` each.

A producer's event connection gets a burst's token events together: the worker's commit
script publishes one per job, and Redis writes them to the connection in one go. redis-py
hands them over one `read_response()` at a time, and each call passes through the
connection, its timeout handling, the parser and its push handler (which formats a debug
message for every push). On the development machine that was 18 µs a push: the 32 events
of a 32-job burst's first step took 0.56 ms to reach their queues. Taking every complete
reply the hiredis reader already holds, after each read, took 0.16-0.21 ms for the same 32.

`BufferedRepliesParser` is redis-py's hiredis parser with `next_buffered()`: the next
reply begun in what the reader already holds, through the parser's own `read_response`,
or `NOTHING` when it holds nothing; and a pub/sub push handler that hands a push on
as it is (redis-py's logs a formatted copy of every push). It reads the parser's hiredis
reader and the connection's parser, which redis-py keeps private: pinned to redis-py
8.1.0, and `tests/integration/test_buffered_replies.py` fails if they change.
"""

from __future__ import annotations

from typing import Any

from redis._parsers.hiredis import _AsyncHiredisParser
from redis.asyncio.connection import AbstractConnection
from redis.utils import HIREDIS_AVAILABLE

PINNED_REDIS_PY = "8.1.0"
NOTHING: Any = object()  # no complete reply is buffered


async def _as_is(push: Any) -> Any:
    return push


class BufferedRepliesParser(_AsyncHiredisParser):
    """redis-py's hiredis parser, whose complete replies can be taken without a read."""

    def __init__(self, socket_read_size: int) -> None:
        super().__init__(socket_read_size)
        self.set_pubsub_push_handler(_as_is)  # type: ignore[no-untyped-call]

    async def next_buffered(self) -> Any:
        """The next reply the reader holds, as the parser's `read_response(push_request=True)`
        gives it (a Redis error as a ResponseError value), or NOTHING. Only the rest of a
        reply begun in the buffer is read from the socket."""
        reader = self._reader
        if reader is None or not self._connected or not reader.has_data():
            return NOTHING
        return await self.read_response(push_request=True)


def parser_kwargs() -> dict[str, Any]:
    """The connection keyword that gives a new connection this parser; none where hiredis
    is not installed (redis-py's own parser then reads one reply at a time)."""
    return {"parser_class": BufferedRepliesParser} if HIREDIS_AVAILABLE else {}


def buffered_replies(connection: AbstractConnection) -> BufferedRepliesParser | None:
    """The connection's parser, where it can give buffered replies; else None."""
    parser = getattr(connection, "_parser", None)
    return parser if isinstance(parser, BufferedRepliesParser) else None

"""The replies a connection has already read, taken without a `read_response()` each.

A producer's event connection gets a burst's token events together: the worker's commit
script publishes one per job, and Redis writes them to the connection in one go. redis-py
hands them over one `read_response()` at a time, and each call passes through the
connection, its timeout handling, the parser and its push handler (which formats a debug
message for every push). On the development machine that was 18 µs a push: the 32 events
of a 32-job burst's first step took 0.56 ms to reach their queues. Taking every complete
reply the hiredis reader already holds, after each read, took 0.16 ms for the same 32.

`BufferedRepliesParser` is redis-py's hiredis parser with `next_buffered()`: the next
complete reply already read from the socket, as `read_response(push_request=True)` would
give it, or `NOTHING`. It reads redis-py's parser internals (the hiredis reader, the push
notification type, the connected flag) and the connection's parser: pinned to redis-py
8.1.0, and `tests/integration/test_buffered_replies.py` fails if they change.
"""

from __future__ import annotations

from typing import Any

from redis._parsers.hiredis import NOT_ENOUGH_DATA, _AsyncHiredisParser
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.utils import HIREDIS_AVAILABLE

PINNED_REDIS_PY = "8.1.0"
NOTHING: Any = object()  # no complete reply is buffered
_PUBSUB_KINDS = frozenset({b"message", b"subscribe", b"unsubscribe"})


class BufferedRepliesParser(_AsyncHiredisParser):
    """redis-py's hiredis parser, whose complete replies can be taken without a read."""

    async def next_buffered(self) -> Any:
        """The next complete reply the reader holds, or NOTHING. A Redis error comes back
        as a ResponseError, not raised (`read_response` raises it); a push other than a
        pub/sub message or confirmation goes to redis-py's push handlers first, as
        `read_response` sends it."""
        reader = self._reader
        if reader is None or not self._connected:
            return NOTHING
        response = reader.gets()
        if response is NOT_ENOUGH_DATA:
            return NOTHING
        if isinstance(response, RedisConnectionError):
            raise response
        push_type = self._hiredis_PushNotificationType
        if push_type is not None and isinstance(response, push_type):
            if response and response[0] in _PUBSUB_KINDS:
                return response  # what redis-py's pub/sub push handler returns
            return await self.handle_push_response(response)
        if (
            isinstance(response, list)
            and response
            and isinstance(response[0], RedisConnectionError)
        ):
            raise response[0]
        return response


def parser_kwargs() -> dict[str, Any]:
    """The connection keyword that gives a new connection this parser; none where hiredis
    is not installed (redis-py's own parser then reads one reply at a time)."""
    return {"parser_class": BufferedRepliesParser} if HIREDIS_AVAILABLE else {}


def buffered_replies(connection: AbstractConnection) -> BufferedRepliesParser | None:
    """The connection's parser, where it can give buffered replies; else None."""
    parser = getattr(connection, "_parser", None)
    return parser if isinstance(parser, BufferedRepliesParser) else None

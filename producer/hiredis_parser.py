"""BufferedRepliesParser: redis-py's hiredis parser, whose complete replies can be taken
without a read each.

It is built on redis-py's private ``_AsyncHiredisParser``: import it only through
buffered_replies.py, which checks first that redis-py has the shape relied on here.
"""

from __future__ import annotations

from typing import Any

from redis._parsers.hiredis import _AsyncHiredisParser


async def _as_is(push: Any) -> Any:
    return push


class BufferedRepliesParser(_AsyncHiredisParser):
    """redis-py's hiredis parser, whose complete replies can be taken without a read."""

    def __init__(self, socket_read_size: int) -> None:
        super().__init__(socket_read_size)
        self.set_pubsub_push_handler(_as_is)  # type: ignore[no-untyped-call]

    def has_buffered(self) -> bool:
        """Whether the reader holds (the start of) a reply. False where the parser's
        internals are not as expected: the caller then reads one reply at a time."""
        reader = getattr(self, "_reader", None)
        return reader is not None and getattr(self, "_connected", False) and reader.has_data()

    async def next_buffered(self) -> Any:
        """The next reply, begun in what the reader holds (see has_buffered), as the parser's
        `read_response(push_request=True)` gives it (a Redis error as a ResponseError
        value). Only the rest of a reply begun in the buffer is read from the socket."""
        return await self.read_response(push_request=True)

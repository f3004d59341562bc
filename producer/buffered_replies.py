"""The replies a connection has already read, taken without a `read_response()` each.

A producer's event connection gets a burst's token events together: the worker's commit
script publishes one per job, and Redis writes them to the connection in one go. redis-py
hands them over one `read_response()` at a time, and each call passes through the
connection, its timeout handling, the parser and its push handler (which formats a debug
message for every push). Paid once per event, that path held a step's last event well
behind its first. Taking every complete reply the hiredis reader already holds, after each
read, pays it once per read (docs/PERFORMANCE.md, "The way back, and Redis (always on)").

The parser that does it (hiredis_parser.py) subclasses redis-py's private hiredis parser
and reads its hiredis reader. At import, this module checks that redis-py has the shape it
relies on (the parser class, its push handler, `read_response(push_request=...)`, the
connection's `parser_class` and `_parser`) and that hiredis is installed and taken by
redis-py. Where not (redis-py before 6.2 hands RESP3 pushes to hiredis another way), event
connections keep redis-py's default parser: the SDK works the same, reading one reply at a
time, and a debug line says why.
"""

from __future__ import annotations

import inspect
import logging
from typing import Any, Protocol

from redis.asyncio.connection import AbstractConnection, Connection

log = logging.getLogger(__name__)


class BufferedReplies(Protocol):
    def has_buffered(self) -> bool: ...

    async def next_buffered(self) -> Any: ...


def _base_problem() -> str | None:
    """What is missing from redis-py's hiredis parser for the subclass, or None."""
    try:
        from redis._parsers import hiredis as parsers
        from redis.utils import HIREDIS_AVAILABLE
    except ImportError as exc:
        return f"redis-py has no redis._parsers.hiredis ({exc})"
    if not HIREDIS_AVAILABLE:
        return "hiredis is not installed, or redis-py does not take its version"
    base = getattr(parsers, "_AsyncHiredisParser", None)
    if not isinstance(base, type):
        return "redis-py has no _AsyncHiredisParser"
    if not callable(getattr(base, "set_pubsub_push_handler", None)):
        return "redis-py's hiredis parser has no set_pubsub_push_handler"
    read_response = getattr(base, "read_response", None)
    if read_response is None or "push_request" not in inspect.signature(read_response).parameters:
        return "redis-py's hiredis parser takes no push_request"
    return None


def find_parser() -> tuple[type[Any] | None, str]:
    """The parser class to give event connections, or None (redis-py's default) and why."""
    problem = _base_problem()
    if problem is not None:
        return None, problem
    try:
        from exlq.producer.hiredis_parser import BufferedRepliesParser

        connection = Connection(parser_class=BufferedRepliesParser)
        parser = getattr(connection, "_parser", None)
    except Exception as exc:  # any failure here means: not this parser
        return None, f"redis-py's hiredis parser could not be extended ({exc!r})"
    if not isinstance(parser, BufferedRepliesParser) or not hasattr(parser, "_reader"):
        return None, "redis-py's connection keeps its parser otherwise"
    return BufferedRepliesParser, "hiredis"


PARSER_CLASS, WHY = find_parser()
if PARSER_CLASS is None:
    log.debug("event connections read one reply at a time (redis-py's parser): %s", WHY)


def parser_kwargs() -> dict[str, Any]:
    """The connection keyword that gives a new connection the buffered-replies parser; none
    where it cannot be used here (redis-py's own parser then reads one reply at a time)."""
    return {} if PARSER_CLASS is None else {"parser_class": PARSER_CLASS}


def buffered_replies(connection: AbstractConnection) -> BufferedReplies | None:
    """The connection's parser, where it can give buffered replies; else None."""
    parser = getattr(connection, "_parser", None)
    return parser if PARSER_CLASS is not None and isinstance(parser, PARSER_CLASS) else None

"""What an install brings that speed relies on: on the versions constraints.txt pins, the
hiredis fast paths are on. (On others they may be off, and the SDK still works: see
tests/integration/test_slow_paths.py.) Fails on an upgrade that turns one off."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser

from exlq.producer import buffered_replies
from exlq.protocol import command_packing


def test_redis_replies_are_parsed_by_hiredis() -> None:
    # A worker's read of 128 entries took 5.2 ms with redis-py's own parser and 1.5 ms
    # with hiredis (docs/PERFORMANCE.md); an install without it is slow, not broken.
    client = aioredis.Redis()
    connection = client.connection_pool.make_connection()
    assert isinstance(connection._parser, _AsyncHiredisParser)


def test_event_connections_take_buffered_replies() -> None:
    assert buffered_replies.PARSER_CLASS is not None, buffered_replies.WHY


def test_commands_are_packed_in_c() -> None:
    assert command_packing.packs_in_c(), command_packing._WHY

"""What an install brings that speed relies on."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis._parsers import _AsyncHiredisParser


def test_redis_replies_are_parsed_by_hiredis() -> None:
    # A worker's read of 128 entries took 5.2 ms with redis-py's own parser and 1.5 ms
    # with hiredis (docs/PERFORMANCE.md); an install without it is slow, not broken.
    client = aioredis.Redis()
    connection = client.connection_pool.make_connection()
    assert isinstance(connection._parser, _AsyncHiredisParser)

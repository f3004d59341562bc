"""The event connection takes every reply a read brought from the parser's buffer
(producer/buffered_replies.py), against a real Redis: the same replies, in the same
order, as one `read_response()` each would give, on the redis-py version it is pinned to."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis
import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from exlq.producer import buffered_replies
from exlq.producer.buffered_replies import NOTHING, BufferedRepliesParser, parser_kwargs
from exlq.producer.subscriber import EventRouter, event_connection

pytestmark = pytest.mark.integration

_PUBLISH_LUA = """
for i = 1, tonumber(ARGV[1]) do
  redis.call('PUBLISH', KEYS[(i - 1) % #KEYS + 1], 'event-' .. i)
end
return 'published'
"""


def test_the_redis_py_it_reads_the_internals_of_is_the_pinned_one() -> None:
    # BufferedRepliesParser reads redis-py's hiredis parser (its reader, its push type,
    # its connected flag) and the connection's parser: check them again on any upgrade.
    assert redis.__version__ == buffered_replies.PINNED_REDIS_PY
    assert parser_kwargs() == {"parser_class": BufferedRepliesParser}


async def _connection(client: aioredis.Redis) -> Any:
    conn = event_connection(client)  # as the router makes its own
    await conn.connect()  # type: ignore[no-untyped-call]
    return conn


async def _read_all(conn: Any, count: int) -> list[object]:
    """`count` replies: one read, then what the parser holds, until all are in."""
    parser = buffered_replies.buffered_replies(conn)
    assert parser is not None
    got: list[object] = []
    while len(got) < count:
        try:
            got.append(await conn.read_response(disconnect_on_error=False, push_request=True))
        except ResponseError as exc:
            got.append(exc)
        while (more := await parser.next_buffered()) is not NOTHING:
            got.append(more)
    return got


async def test_a_writes_replies_and_pushes_come_back_whole_and_in_order(
    redis_client: aioredis.Redis,
) -> None:
    conn = await _connection(redis_client)
    try:
        await conn.send_packed_command(
            conn.pack_commands(
                [
                    ("SUBSCRIBE", "ch-a", "ch-b"),
                    ("EVAL", _PUBLISH_LUA, 2, "ch-a", "ch-b", 32),
                    ("EVAL", "return redis.error_reply('refused here')", 0),
                    ("PING",),
                ]
            )
        )
        got = await _read_all(conn, 2 + 32 + 3)
        assert got[:2] == [[b"subscribe", b"ch-a", 1], [b"subscribe", b"ch-b", 2]]
        channels = [b"ch-a", b"ch-b"]
        assert got[2:34] == [
            [b"message", channels[i % 2], f"event-{i + 1}".encode()] for i in range(32)
        ]
        assert got[34] == b"published"
        # A Redis error is handed back as a value, as the router's reply matching needs.
        assert isinstance(got[35], ResponseError)
        assert "refused here" in str(got[35])
        assert got[36] == b"PONG"
        # Nothing more is buffered, and asking again does not read the socket.
        parser = buffered_replies.buffered_replies(conn)
        assert parser is not None
        assert await parser.next_buffered() is NOTHING
    finally:
        await conn.disconnect()


async def test_a_disconnected_connection_gives_nothing_buffered(
    redis_client: aioredis.Redis,
) -> None:
    conn = await _connection(redis_client)
    parser = buffered_replies.buffered_replies(conn)
    await conn.disconnect()
    assert parser is not None
    assert await parser.next_buffered() is NOTHING


async def _route_a_burst(client: aioredis.Redis) -> None:
    router = EventRouter(client, "exlq:out:{check}", "exlq:{q}:job:check")
    try:
        channels = [f"ch-{i}" for i in range(32)]
        queues, reply = await router.subscribe_then(
            channels, ("EVAL", _PUBLISH_LUA, len(channels), *channels, 3 * len(channels))
        )
        assert reply == b"published"
        for i, queue in enumerate(queues):
            got = [await asyncio.wait_for(queue.get(), 5) for _ in range(3)]
            # Channel i got events i+1, i+33, i+65: each queue its own, in order.
            assert got == [f"event-{i + 1 + 32 * k}".encode() for k in range(3)]
    finally:
        await router.close()


async def test_the_router_hands_a_burst_of_events_to_their_queues_in_order(
    redis_client: aioredis.Redis,
) -> None:
    await _route_a_burst(redis_client)


async def test_without_hiredis_the_router_reads_one_reply_at_a_time(
    redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(buffered_replies, "HIREDIS_AVAILABLE", False)
    assert parser_kwargs() == {}
    await _route_a_burst(redis_client)

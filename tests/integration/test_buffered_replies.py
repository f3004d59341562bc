"""The event connection takes every reply a read brought from the parser's buffer
(producer/buffered_replies.py), against a real Redis: the same replies, in the same
order, as one `read_response()` each would give. Where redis-py lacks the private parser
shape it relies on, event connections keep redis-py's own parser and work the same."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis
import redis.utils
from redis._parsers import hiredis as redis_hiredis_parsers
from redis.exceptions import ResponseError

from exlq.producer import buffered_replies
from exlq.producer.buffered_replies import find_parser, parser_kwargs
from exlq.producer.subscriber import EventRouter, event_connection

pytestmark = pytest.mark.integration

needs_parser = pytest.mark.skipif(
    buffered_replies.PARSER_CLASS is None,
    reason=f"no buffered replies with this redis-py: {buffered_replies.WHY}",
)

_PUBLISH_LUA = """
for i = 1, tonumber(ARGV[1]) do
  redis.call('PUBLISH', KEYS[(i - 1) % #KEYS + 1], 'event-' .. i)
end
return 'published'
"""


@needs_parser
def test_new_event_connections_get_the_buffered_replies_parser() -> None:
    assert parser_kwargs() == {"parser_class": buffered_replies.PARSER_CLASS}


async def _connection(client: aioredis.Redis) -> Any:
    conn = event_connection(client)  # as the router makes its own
    await conn.connect()  # type: ignore[no-untyped-call]
    return conn


async def _read_all(conn: Any, count: int) -> tuple[list[object], int]:
    """`count` replies: one read, then what the parser holds, until all are in; and how
    many came from what the parser held."""
    parser = buffered_replies.buffered_replies(conn)
    assert parser is not None
    got: list[object] = []
    buffered = 0
    while len(got) < count:
        try:
            got.append(await conn.read_response(disconnect_on_error=False, push_request=True))
        except ResponseError as exc:
            got.append(exc)
        while parser.has_buffered():
            got.append(await parser.next_buffered())
            buffered += 1
    return got, buffered


@needs_parser
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
        got, buffered = await _read_all(conn, 2 + 32 + 3)
        # Redis wrote them together: most were taken from the buffer, not read one by one.
        assert buffered >= (2 + 32 + 3) // 2, buffered
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
        assert not parser.has_buffered()
    finally:
        await conn.disconnect()


@needs_parser
async def test_a_disconnected_connection_gives_nothing_buffered(
    redis_client: aioredis.Redis,
) -> None:
    conn = await _connection(redis_client)
    await conn.send_packed_command(conn.pack_commands([("PING",), ("PING",)]))
    assert await conn.read_response() == b"PONG"
    parser = buffered_replies.buffered_replies(conn)
    assert parser is not None
    await conn.disconnect()
    assert not parser.has_buffered()


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


async def test_without_the_parser_the_router_reads_one_reply_at_a_time(
    redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(buffered_replies, "PARSER_CLASS", None)
    assert parser_kwargs() == {}
    conn = event_connection(redis_client)
    assert buffered_replies.buffered_replies(conn) is None
    await _route_a_burst(redis_client)


class _ParserOfRedisPy5:
    """The shape of redis-py 5.x's hiredis parser: no push handler, no push_request."""

    def __init__(self, socket_read_size: int) -> None:
        self._reader = None

    async def read_response(self, disable_decoding: bool = False) -> Any:
        raise AssertionError("never read")


@pytest.mark.parametrize(
    ("stand_in", "why"),
    [
        (None, "no _AsyncHiredisParser"),
        (_ParserOfRedisPy5, "no set_pubsub_push_handler"),
    ],
    ids=["parser-missing", "parser-of-redis-py-5"],
)
async def test_a_redis_py_without_the_parsers_shape_falls_back_and_still_routes_events(
    redis_client: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch,
    stand_in: type[Any] | None,
    why: str,
) -> None:
    if stand_in is None:
        monkeypatch.delattr(redis_hiredis_parsers, "_AsyncHiredisParser")
    else:
        monkeypatch.setattr(redis_hiredis_parsers, "_AsyncHiredisParser", stand_in)
    found, reason = find_parser()
    assert found is None
    assert why in reason
    monkeypatch.setattr(buffered_replies, "PARSER_CLASS", found)
    await _route_a_burst(redis_client)


def test_without_hiredis_in_redis_py_no_parser_is_given(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis.utils, "HIREDIS_AVAILABLE", False)
    found, reason = find_parser()
    assert found is None
    assert "hiredis is not installed" in reason


def test_a_push_request_without_a_push_handler_is_refused_too(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    class _NoPushRequest(_ParserOfRedisPy5):
        def set_pubsub_push_handler(self, handler: Any) -> None:
            pass

    monkeypatch.setattr(redis_hiredis_parsers, "_AsyncHiredisParser", _NoPushRequest)
    found, reason = find_parser()
    assert found is None
    assert "push_request" in reason

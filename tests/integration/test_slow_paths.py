"""Where redis-py lacks the private parts the hiredis fast paths build on (another
redis-py version), the SDK and the worker use redis-py's public ones and a job goes
through whole, on a real Redis."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from redis._parsers import hiredis as redis_hiredis_parsers
from redis.asyncio.connection import Connection

from exlq import AsyncProducer, DoneEvent, TokenEvent
from exlq.producer import buffered_replies
from exlq.protocol import command_packing

pytestmark = pytest.mark.integration


@pytest.fixture
def without_private_redis_py(monkeypatch: pytest.MonkeyPatch) -> None:
    """As on a redis-py without the hiredis parser class and serializer the fast paths
    extend: the detection runs again without them, and its answers are the ones in force
    (the classes come back for redis-py's own use: its sync client packs with one)."""
    with monkeypatch.context() as missing:
        missing.delattr(redis_hiredis_parsers, "_AsyncHiredisParser")
        missing.delattr("redis.connection.HiredisRespSerializer")
        parser, parser_why = buffered_replies.find_parser()
        packer, packer_why = command_packing.find_c_packer()
    assert parser is None and "_AsyncHiredisParser" in parser_why
    assert packer is None and "HiredisRespSerializer" in packer_why
    monkeypatch.setattr(buffered_replies, "PARSER_CLASS", parser)
    monkeypatch.setattr(command_packing, "_PACKER", packer)


@pytest.mark.usefixtures("without_private_redis_py")
async def test_a_burst_streams_and_ends_whole_on_redis_pys_public_api(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        following = producer._redis.connection_pool.connection_class
        assert following.locator.base_class is Connection  # what follows the slot: plain
        assert buffered_replies.buffered_replies(producer._router._conn) is None
        handles = await asyncio.gather(
            *(producer.submit(f"café 漢字 {i}", max_new_tokens=4) for i in range(40))
        )
        streamed = [event async for event in handles[0].stream()]
        results = await asyncio.gather(*(h.result(timeout=20) for h in handles[1:]))
    assert isinstance(streamed[-1], DoneEvent)
    assert "".join(e.text for e in streamed if isinstance(e, TokenEvent)) == " café 漢字 0 café"
    assert [r.text for r in results] == [f" café 漢字 {i} café" for i in range(1, 40)]

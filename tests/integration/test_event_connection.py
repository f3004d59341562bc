"""The producer's event connection: the subscription and the script in one write, replies
matched to their writes in order, and clear errors when Redis refuses the job channels."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator
from typing import Any

import pytest
import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from exlq.producer import AsyncProducer, subscriber
from exlq.producer.subscriber import EventRouter
from exlq.protocol.keys import QueueKeys

pytestmark = pytest.mark.integration

# Sleeps ~0.3 s inside Redis, then answers: a write whose reply is still due.
_SLOW_LUA = """
local t = redis.call('TIME')
local start = t[1] * 1000000 + t[2]
repeat
  t = redis.call('TIME')
until t[1] * 1000000 + t[2] - start > 300000
return 'slow'
"""


async def _event_connection(client: aioredis.Redis, name: str) -> dict[str, Any]:
    """The CLIENT LIST entry of the one connection named ``name`` that holds channels."""
    held = [c for c in await client.client_list() if c["name"] == name and int(c["sub"]) > 0]
    assert len(held) == 1, held
    return held[0]


async def test_the_script_runs_on_the_subscribed_connection_after_the_subscribe(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    await start_worker()
    url = f"{redis_url}?client_name=one-write"
    async with AsyncProducer(url, queue=queue_name) as producer:
        handle = await producer.submit("one write", max_new_tokens=2)
        assert producer._router.commands_while_subscribed
        events = await _event_connection(redis_client, "one-write")
        # The same connection that holds the job's channel ran the submit script.
        assert events["cmd"] == "evalsha"
        assert (await handle.result(timeout=10)).text == " one write"


async def test_replies_meet_their_writes_when_a_caller_gives_up_waiting(
    redis_url: str, redis_client: aioredis.Redis
) -> None:
    router = EventRouter(redis_client, "exlq:out:{check}", "exlq:{q}:job:check")
    try:
        slow = asyncio.create_task(router.subscribe_then(["ch-slow"], ("EVAL", _SLOW_LUA, 0)))
        await asyncio.sleep(0.1)  # written; Redis is inside the script
        slow.cancel()
        with pytest.raises(asyncio.CancelledError):
            await slow
        # The slow reply comes first and is dropped; this write gets its own.
        queues, reply = await router.subscribe_then(["ch-next"], ("ECHO", "next"))
        assert reply == b"next"
        assert router.channel_count == 1
        await redis_client.publish("ch-next", "hello")
        assert await asyncio.wait_for(queues[0].get(), 5) == b"hello"
    finally:
        await router.close()


async def test_a_write_not_answered_in_time_raises_and_the_next_gets_its_own_reply(
    redis_client: aioredis.Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(subscriber, "REPLY_TIMEOUT_S", 0.1)
    router = EventRouter(redis_client, "exlq:out:{check}", "exlq:{q}:job:check")
    try:
        with pytest.raises(RedisTimeoutError, match="did not answer within"):
            await router.subscribe_then(["ch-slow"], ("EVAL", _SLOW_LUA, 0))
        assert router.channel_count == 0
        monkeypatch.setattr(subscriber, "REPLY_TIMEOUT_S", 5.0)  # Redis ends the script
        _, reply = await router.subscribe_then(["ch-next"], ("ECHO", "next"))
        assert reply == b"next"
    finally:
        await router.close()


@pytest.fixture
async def limited_user(redis_url: str, redis_client: aioredis.Redis) -> AsyncIterator[str]:
    """A producer user that may touch every key but no channel but ``allowed:*``."""
    name = "no-job-channels"
    await redis_client.acl_setuser(
        name,
        enabled=True,
        passwords=["+pw"],
        keys=["*"],
        channels=["allowed:*"],
        reset_channels=True,
        commands=["+@all"],
    )
    yield redis_url.replace("redis://", f"redis://{name}:pw@", 1)
    await redis_client.acl_deluser(name)


async def test_a_user_without_the_job_channels_fails_at_the_first_submit_with_nothing_queued(
    limited_user: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    async with AsyncProducer(limited_user, queue=queue_name) as producer:
        with pytest.raises(NoPermissionError, match="grant this Redis user the job channels"):
            await producer.submit("refused", max_new_tokens=2)
        assert producer._router.channel_count == 0
    assert await redis_client.xlen(QueueKeys(queue_name).jobs) == 0


async def test_channels_taken_away_after_connect_fail_the_submit_and_keep_the_order(
    redis_url: str,
    queue_name: str,
    redis_client: aioredis.Redis,
    caplog: pytest.LogCaptureFixture,
) -> None:
    name = "loses-channels"
    await redis_client.acl_setuser(
        name, enabled=True, passwords=["+pw"], keys=["*"], channels=["*"], commands=["+@all"]
    )
    url = redis_url.replace("redis://", f"redis://{name}:pw@", 1)
    try:
        async with AsyncProducer(url, queue=queue_name) as producer:
            await producer.submit("allowed", max_new_tokens=2)
            caplog.set_level(logging.WARNING)
            await redis_client.acl_setuser(
                name, enabled=True, reset_channels=True, channels=["allowed:*"]
            )
            # Redis drops the connection that held a channel now refused; the router comes
            # back and its next SUBSCRIBE is refused: the error says the script ran.
            with pytest.raises(NoPermissionError, match="ran anyway"):
                for _ in range(50):
                    with contextlib.suppress(ConnectionError, OSError):
                        await producer.submit("after", max_new_tokens=2)
                    await asyncio.sleep(0.1)
            # The channel still held could not be subscribed again, and the log says so.
            assert "subscribing again after a reconnect failed" in caplog.text
            await redis_client.acl_setuser(name, enabled=True, channels=["*"])
            # In order again: the next submit gets its own reply.
            handle = await producer.submit("again", max_new_tokens=2, id="again")
            assert handle.id == "again" and not handle.duplicate
    finally:
        await redis_client.acl_deluser(name)

"""One pub/sub connection per producer that carries the channels of all its jobs."""

from __future__ import annotations

import asyncio
import contextlib
import logging

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from producer.backoff import reconnect_delay_s

log = logging.getLogger(__name__)

SUBSCRIBE_TIMEOUT_S = 10.0
# Put in every queue after the connection came back: events may have been lost meanwhile,
# so each handle looks at its stored result.
RECONNECTED = b""
_READ_POLL_S = 1.0


class EventRouter:
    """Reads one PubSub connection and hands each message to the queue of its channel.

    Subscribing waits for the server's confirmation, so a caller that enqueues a job
    after ``subscribe()`` returns cannot miss its first event.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._pubsub = client.pubsub()
        self._queues: dict[str, asyncio.Queue[bytes]] = {}
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def channel_count(self) -> int:
        return len(self._queues)

    async def subscribe(self, channel: str) -> asyncio.Queue[bytes]:
        async with self._lock:
            if self._reader is None:
                await self._pubsub.connect()  # type: ignore[no-untyped-call]
                self._reader = asyncio.create_task(self._read_loop(), name="exlq-event-router")
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        confirmed = asyncio.get_running_loop().create_future()
        self._queues[channel] = queue
        self._confirmations[channel] = confirmed
        try:
            await self._pubsub.subscribe(channel)
            await asyncio.wait_for(confirmed, SUBSCRIBE_TIMEOUT_S)
        except BaseException:
            self._queues.pop(channel, None)
            self._confirmations.pop(channel, None)
            raise
        return queue

    async def unsubscribe(self, channel: str) -> None:
        if self._queues.pop(channel, None) is None:
            return
        with contextlib.suppress(RedisConnectionError, RedisTimeoutError):
            await self._pubsub.unsubscribe(channel)

    async def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        await self._pubsub.aclose()  # type: ignore[no-untyped-call]
        self._queues.clear()

    async def _read_loop(self) -> None:
        failures = 0
        while True:
            try:
                message = await self._pubsub.get_message(timeout=_READ_POLL_S)
            except asyncio.CancelledError:
                raise
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                delay = reconnect_delay_s(failures)
                failures += 1
                log.warning("pub/sub connection lost (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
                continue
            if failures:  # back: redis-py has resubscribed every channel
                failures = 0
                for queue in self._queues.values():
                    queue.put_nowait(RECONNECTED)
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, object]) -> None:
        raw_channel = message["channel"]
        channel = raw_channel.decode() if isinstance(raw_channel, bytes) else str(raw_channel)
        kind = message["type"]
        if kind == "message":
            queue = self._queues.get(channel)
            data = message["data"]
            if queue is not None and isinstance(data, bytes):
                queue.put_nowait(data)
        elif kind == "subscribe":
            confirmed = self._confirmations.pop(channel, None)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

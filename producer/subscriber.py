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
    """Reads one PubSub connection and hands each message to the queues of its channel.

    Subscribing waits for the server's confirmation, so a caller that enqueues a job
    after ``subscribe_many()`` returns cannot miss its first event. Two handles of one job
    (the same id submitted twice) each get a queue of their own; the channel is left when
    the last of them lets go.
    """

    def __init__(self, client: aioredis.Redis) -> None:
        self._pubsub = client.pubsub()
        self._queues: dict[str, list[asyncio.Queue[bytes]]] = {}
        self._confirmations: dict[str, asyncio.Future[None]] = {}
        self._reader: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()

    @property
    def channel_count(self) -> int:
        return len(self._queues)

    async def subscribe_many(self, channels: list[str]) -> list[asyncio.Queue[bytes]]:
        """One queue per entry of ``channels``, returned once the server has confirmed every
        channel; one SUBSCRIBE carries those not yet subscribed. On failure, none of the
        queues stays registered."""
        async with self._lock:
            if self._reader is None:
                await self._pubsub.connect()  # type: ignore[no-untyped-call]
                self._reader = asyncio.create_task(self._read_loop(), name="exlq-event-router")
        loop = asyncio.get_running_loop()
        queues: list[asyncio.Queue[bytes]] = []
        new: list[str] = []
        waits: list[asyncio.Future[None]] = []
        for channel in channels:
            queue: asyncio.Queue[bytes] = asyncio.Queue()
            queues.append(queue)
            if channel not in self._queues:
                self._queues[channel] = []
                self._confirmations[channel] = loop.create_future()
                new.append(channel)
            self._queues[channel].append(queue)
            confirmed = self._confirmations.get(channel)
            if confirmed is not None:  # None: confirmed long ago
                waits.append(confirmed)
        try:
            if new:
                await self._pubsub.subscribe(*new)
            await asyncio.wait_for(asyncio.gather(*waits), SUBSCRIBE_TIMEOUT_S)
        except BaseException:
            await self.unsubscribe_many(list(zip(channels, queues, strict=True)))
            raise
        return queues

    async def unsubscribe_many(self, subscriptions: list[tuple[str, asyncio.Queue[bytes]]]) -> None:
        """Drop these (channel, queue) pairs; leave every channel that has no queue left."""
        emptied: list[str] = []
        for channel, queue in subscriptions:
            held = self._queues.get(channel)
            if held is None or queue not in held:
                continue
            held.remove(queue)
            if not held:
                del self._queues[channel]
                self._confirmations.pop(channel, None)
                emptied.append(channel)
        if emptied:
            with contextlib.suppress(RedisConnectionError, RedisTimeoutError):
                await self._pubsub.unsubscribe(*emptied)

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
                for held in self._queues.values():
                    for queue in held:
                        queue.put_nowait(RECONNECTED)
            if message is not None:
                self._dispatch(message)

    def _dispatch(self, message: dict[str, object]) -> None:
        raw_channel = message["channel"]
        channel = raw_channel.decode() if isinstance(raw_channel, bytes) else str(raw_channel)
        kind = message["type"]
        if kind == "message":
            data = message["data"]
            if isinstance(data, bytes):
                for queue in self._queues.get(channel, ()):
                    queue.put_nowait(data)
        elif kind == "subscribe":
            confirmed = self._confirmations.pop(channel, None)
            if confirmed is not None and not confirmed.done():
                confirmed.set_result(None)

"""One RESP3 connection per producer: the channels of all its jobs, and the command that
must run once they are subscribed.

Redis runs the commands of one connection in the order they arrive, and under RESP3 a
subscribed connection may still run any command. So a SUBSCRIBE and the script that
enqueues the jobs go out in one write on this connection, and the script runs only after
every channel is subscribed: no job can publish an event its producer misses, and a submit
costs one round trip, not a SUBSCRIBE, its confirmations, then the script.

What arrives on the connection is of two kinds. Pushes (``message``, ``subscribe``,
``unsubscribe``) carry events and confirmations. Replies answer the commands sent here, in
the order they were sent; each write waits for one reply, after the ``subscribe``
confirmations of its channels. A SUBSCRIBE that Redis refuses (an ACL without the
channel) replies with one error instead of its confirmations, and the count of
confirmations still due tells that error from the command's reply.

A server that runs nothing but pub/sub commands on a subscribed connection (fakeredis, a
RESP2-only proxy) is found at connect. There the router waits for the confirmations, then
runs the command on the client's pool: two round trips, the same order.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections import Counter, deque
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TypeGuard

import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import EncodableT

from exlq.producer.buffered_replies import buffered_replies, parser_kwargs
from exlq.protocol.backoff import reconnect_delay_s
from exlq.protocol.command_packing import packed_in_c

log = logging.getLogger(__name__)

# How long a write here may wait for its answer, or a sender for a lost connection to come
# back, before it fails with a Redis timeout.
REPLY_TIMEOUT_S = 10.0
# Put in every queue after the connection came back: events may have been lost meanwhile,
# so each handle looks at its stored result.
RECONNECTED = b""
_PUSH_KINDS = frozenset(
    {b"message", b"subscribe", b"unsubscribe", b"smessage", b"ssubscribe", b"sunsubscribe"}
)

Command = Sequence[EncodableT]


@dataclass(slots=True)
class _Sent:
    """One write on the connection, waiting for what Redis owes it."""

    confirmations: int  # ``subscribe`` pushes still due
    reply: asyncio.Future[object] | None  # None: nobody waits (a resubscription)
    wants_reply: bool = True  # False: done once the confirmations are in
    refused: ResponseError | None = None  # the SUBSCRIBE's own error


def _is_push(response: object) -> TypeGuard[list[bytes]]:
    """Pushes are 3-item lists led by their kind; no command sent here replies with one."""
    return isinstance(response, list) and len(response) == 3 and response[0] in _PUSH_KINDS


def _settle(reply: asyncio.Future[object] | None, result: object) -> None:
    if reply is None or reply.done():  # done: its caller was cancelled or timed out
        return
    if isinstance(result, BaseException):
        reply.set_exception(result)
    else:
        reply.set_result(result)


def event_connection(client: aioredis.Redis) -> AbstractConnection:
    """A new, unconnected connection for events: the client's own settings (address, TLS,
    credentials), speaking RESP3, with replies as bytes whatever the client decodes; its
    writes packed in C, and what it has read taken whole after each read
    (buffered_replies)."""
    pool = client.connection_pool
    connection: AbstractConnection = packed_in_c(pool.connection_class)(
        **{**pool.connection_kwargs, "protocol": 3, "decode_responses": False, **parser_kwargs()}
    )
    return connection


class EventRouter:
    """Reads the connection and hands each event to the queues of its channel.

    Two handles of one job (the same id submitted twice) each get a queue of their own;
    the channel is left when the last of them lets go. After a lost connection, it
    reconnects with backoff, subscribes every channel again, and puts ``RECONNECTED`` in
    every queue. ``check_channel`` and ``check_key`` are a job's channel and state key,
    used once at connect to check what the server allows.
    """

    def __init__(
        self,
        client: aioredis.Redis,
        check_channel: str,
        check_key: str,
        shard_check_channel: str | None = None,
    ) -> None:
        self._client = client
        self._check_channel = check_channel
        self._check_key = check_key
        # On a Redis Cluster that has sharded pub/sub (Redis >= 7), every channel here is a
        # shard channel in the queue's slot (wire version 2), subscribed with SSUBSCRIBE:
        # found at connect, with this channel; None: never.
        self._shard_check_channel = shard_check_channel
        self.sharded: bool | None = None  # None: not connected yet
        # Channels this side asked to leave, whose confirmations are still due: any other
        # sunsubscribe that comes is Redis dropping a channel whose slot moved away.
        self._leaving: Counter[str] = Counter()
        self._subscribe, self._unsubscribe = "SUBSCRIBE", "UNSUBSCRIBE"
        self._conn = event_connection(client)
        self._buffered = buffered_replies(self._conn)  # its parser, kept across reconnects
        self._queues: dict[str, list[asyncio.Queue[bytes]]] = {}
        self._sent: deque[_Sent] = deque()
        self._send_lock = asyncio.Lock()
        self._up = asyncio.Event()  # connected, and every held channel asked for
        self._reader: asyncio.Task[None] | None = None
        self._starting: asyncio.Future[None] | None = None
        self.commands_while_subscribed = True  # found at connect

    @property
    def channel_count(self) -> int:
        return len(self._queues)

    async def subscribe_then(
        self, channels: list[str], command: Command, then: Command | None = None
    ) -> tuple[list[asyncio.Queue[bytes]], object]:
        """One queue per entry of ``channels``, and ``command``'s reply: Redis runs the
        command once every channel is subscribed. On failure (the command's error too),
        none of the queues stays registered. The command must not reply with nil or with
        a 3-item list led by a pub/sub kind. ``then``: a command sent right behind it on
        the same connection (WAIT, which counts that connection's writes); the reply is
        then the pair of replies."""
        queues: list[asyncio.Queue[bytes]] = []
        new: list[str] = []
        for channel in channels:
            queue: asyncio.Queue[bytes] = asyncio.Queue()
            queues.append(queue)
            held = self._queues.setdefault(channel, [])
            if not held:
                new.append(channel)
            held.append(queue)
        try:
            await self.start()
            if self.commands_while_subscribed:
                first: list[Command] = [(self._subscribe, *new)] if new else []
                reply = await self._call([*first, command], len(new), wants_reply=True, then=then)
            else:
                # A channel held already may still wait for its confirmation: ask again
                # (Redis confirms a channel subscribed twice) rather than guess.
                again = list(dict.fromkeys(channels))
                await self._call([(self._subscribe, *again)], len(again), wants_reply=False)
                reply = await self._run_elsewhere(command, then)
        except BaseException:
            await self.unsubscribe_many(list(zip(channels, queues, strict=True)))
            raise
        return queues, reply

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
                emptied.append(channel)
        if emptied:
            with contextlib.suppress(RedisConnectionError, RedisTimeoutError, OSError):
                async with self._send_lock:
                    if self._up.is_set():  # else a reconnect subscribes only what is held
                        self._leaving.update(emptied)
                        await self._send([(self._unsubscribe, *emptied)])

    async def close(self) -> None:
        if self._starting is not None and not self._starting.done():
            self._starting.cancel()
        self._starting = None
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
            self._reader = None
        self._up.clear()
        self._fail_sent(RedisConnectionError("the producer was closed"))
        await self._conn.disconnect()
        self._queues.clear()

    # -- sending -------------------------------------------------------------------------

    async def _run_elsewhere(self, command: Command, then: Command | None) -> object:
        """``command`` (and ``then`` behind it, on the same connection) through the
        client's pool, for a server that runs no command on a subscribed connection."""
        if then is None:
            return await self._client.execute_command(*command)  # type: ignore[no-untyped-call]
        async with self._client.pipeline(transaction=False) as pipe:
            pipe.execute_command(*command)
            pipe.execute_command(*then)
            return list(await pipe.execute())

    async def _call(
        self,
        commands: list[Command],
        confirmations: int,
        wants_reply: bool,
        then: Command | None = None,
    ) -> object:
        loop = asyncio.get_running_loop()
        reply: asyncio.Future[object] = loop.create_future()
        behind: asyncio.Future[object] | None = None
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await self._up.wait()
                async with self._send_lock:
                    if not self._up.is_set():
                        raise RedisConnectionError("the connection for events was just lost")
                    # Appended and written under one lock: the FIFO matches the wire.
                    self._sent.append(_Sent(confirmations, reply, wants_reply))
                    if then is not None:
                        behind = loop.create_future()
                        self._sent.append(_Sent(0, behind, True))
                    await self._send(commands if then is None else [*commands, then])
                # Cancelling the wait cancels the future; what Redis owes it is still
                # read and dropped in turn, so the writes after it meet their replies.
                if behind is None:
                    return await reply
                first, second = await asyncio.gather(reply, behind, return_exceptions=True)
                for answer in (first, second):
                    if isinstance(answer, BaseException):
                        raise answer
                return [first, second]
        except TimeoutError:
            raise RedisTimeoutError(
                f"Redis did not answer within {REPLY_TIMEOUT_S:g}s; the connection "
                "for events is down or Redis is busy"
            ) from None

    async def _send(self, commands: list[Command]) -> None:
        conn = self._conn
        await conn.send_packed_command(conn.pack_commands(commands), check_health=False)

    @property
    def version(self) -> int:
        """The wire version of the channels here: 2 (shard channels) or 1."""
        return 2 if self.sharded else 1

    async def start(self) -> None:
        """Connect on first use, raising if Redis cannot be reached (within
        REPLY_TIMEOUT_S) or refuses this user the job channels; then start reading. The
        submits of a burst that wait for it share one start, and go on together."""
        if self._reader is not None:
            return
        starting = self._starting
        if starting is None or (starting.done() and starting.exception() is not None):
            starting = self._starting = asyncio.ensure_future(self._start_once())
        await asyncio.shield(starting)

    async def _start_once(self) -> None:
        try:
            async with asyncio.timeout(REPLY_TIMEOUT_S):
                await self._connect_and_check()
        except TimeoutError:
            raise RedisTimeoutError(
                f"Redis did not answer the event connection's checks within {REPLY_TIMEOUT_S:g}s"
            ) from None

    async def _connect_and_check(self) -> None:
        async with self._send_lock:
            if self._reader is None:
                try:
                    await self._conn.connect()  # type: ignore[no-untyped-call]
                    await self._check_server()
                except BaseException:
                    await self._conn.disconnect()  # no answer left half read
                    raise
                self._reader = asyncio.create_task(self._read_loop(), name="exlq-event-router")
                self._up.set()

    async def _check_server(self) -> None:
        """Before anything is enqueued: may this user subscribe to job channels, and does
        the server run other commands on a subscribed connection?"""
        answers = await self._answers(
            [
                ("SUBSCRIBE", self._check_channel),
                ("EXISTS", self._check_key),
                ("UNSUBSCRIBE", self._check_channel),
            ]
        )
        if isinstance(answers[0], ResponseError):
            raise type(answers[0])(
                f"{answers[0]} ({self._check_channel}): grant this Redis user the job "
                "channels, as docs/SECURITY.md shows"
            )
        self.commands_while_subscribed = not isinstance(answers[1], ResponseError)
        self.sharded = await self._shards_events()
        if self.sharded:
            self._subscribe, self._unsubscribe = "SSUBSCRIBE", "SUNSUBSCRIBE"
        if not self.commands_while_subscribed:
            log.info(
                "Redis runs only pub/sub commands on a subscribed connection (%s); "
                "a submit takes two round trips",
                answers[1],
            )

    async def _answers(self, commands: list[Command]) -> list[object]:
        """Send ``commands`` (before the reader starts) and read one answer each: a reply,
        a push, or the error Redis gave instead."""
        await self._send(commands)
        answers: list[object] = []
        for _ in commands:
            try:
                answers.append(
                    await self._conn.read_response(disconnect_on_error=False, push_request=True)
                )
            except ResponseError as exc:
                answers.append(exc)
        return answers

    async def _shards_events(self) -> bool:
        """Whether job events go on shard channels: on a Redis Cluster whose node takes
        SSUBSCRIBE for this user (Redis >= 7). On one Redis, sharded pub/sub would buy
        nothing, and the job's own channel is kept."""
        locator = getattr(type(self._conn), "locator", None)
        if self._shard_check_channel is None or not (locator and locator.cluster):
            return False
        channel = self._shard_check_channel
        answers = await self._answers([("SSUBSCRIBE", channel), ("SUNSUBSCRIBE", channel)])
        if isinstance(answers[0], ResponseError):
            log.info(
                "job events on the job's own channel: the Redis Cluster refused SSUBSCRIBE (%s)",
                answers[0],
            )
            return False
        return True

    # -- reading -------------------------------------------------------------------------

    async def _read_loop(self) -> None:
        """One read, then every reply that read brought, taken from the parser's buffer
        (a burst's events arrive together), before the next read."""
        conn = self._conn
        while True:
            try:
                response = await conn.read_response(
                    timeout=math.inf, disconnect_on_error=False, push_request=True
                )
            except ResponseError as exc:
                response = exc
            except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
                await self._reconnect(exc)
                continue
            try:
                self._take(response)
                buffered = self._buffered
                while buffered is not None and buffered.has_buffered():
                    response = await buffered.next_buffered()
                    self._take(response)
            except (RedisConnectionError, OSError) as exc:
                await self._reconnect(exc)
            except Exception as exc:  # what arrived makes no sense here: start afresh
                log.exception("unexpected answer on the event connection: %r", response)
                await self._reconnect(exc)

    def _take(self, response: object) -> None:
        if _is_push(response):
            self._push(response)
        elif response is not None:  # None: a push redis-py handled (maintenance)
            self._reply(response)

    def _push(self, push: list[bytes]) -> None:
        kind, raw_channel, data = push
        if kind in (b"message", b"smessage"):
            for queue in self._queues.get(raw_channel.decode(), ()):
                queue.put_nowait(data)
        elif kind in (b"unsubscribe", b"sunsubscribe"):
            channel = raw_channel.decode()
            if self._leaving[channel] > 0:
                self._leaving[channel] -= 1
                if not self._leaving[channel]:
                    del self._leaving[channel]
            elif kind == b"sunsubscribe" and channel in self._queues:
                # Unasked: the slot moved to another node (resharding, failover). Connect
                # again, to where the slot is now, and subscribe there.
                raise RedisConnectionError(f"Redis moved {channel}'s slot")
        elif kind in (b"subscribe", b"ssubscribe") and self._sent and self._sent[0].confirmations:
            head = self._sent[0]
            head.confirmations -= 1
            if not head.confirmations and not head.wants_reply:
                self._sent.popleft()
                _settle(head.reply, None)

    def _reply(self, response: object) -> None:
        if not self._sent:
            log.error("Redis sent a reply nothing waits for: %r", response)
            return
        head = self._sent[0]
        if head.confirmations:
            # The SUBSCRIBE was refused: its error came instead of its confirmations.
            head.confirmations = 0
            if isinstance(response, ResponseError):
                head.refused = response
            if not head.wants_reply:
                self._sent.popleft()
                if head.reply is None:
                    log.error("subscribing again after a reconnect failed: %s", response)
                _settle(head.reply, response)
            return
        self._sent.popleft()
        if head.refused is not None:
            # The command ran, but its events cannot arrive: say so, and what to fix.
            response = type(head.refused)(
                f"{head.refused}; the command after the SUBSCRIBE ran anyway (the jobs "
                "of this submit may be queued): grant this Redis user the job channels"
            )
        _settle(head.reply, response)

    def _fail_sent(self, exc: Exception) -> None:
        while self._sent:
            _settle(self._sent.popleft().reply, exc)

    async def _reconnect(self, exc: Exception) -> None:
        """Fail what waits for an answer, then connect and subscribe every channel again."""
        self._up.clear()
        self._fail_sent(RedisConnectionError(f"connection for events lost: {exc}"))
        failures = 0
        while True:
            delay = reconnect_delay_s(failures)
            failures += 1
            log.warning("pub/sub connection lost (%s); retrying in %.1fs", exc, delay)
            await asyncio.sleep(delay)
            try:
                await self._conn.disconnect()
                await self._conn.connect()  # type: ignore[no-untyped-call]
                async with self._send_lock:
                    # Writes that raced the loss went to the old connection.
                    self._fail_sent(RedisConnectionError(f"connection for events lost: {exc}"))
                    self._leaving.clear()  # a new connection owes no confirmations
                    if self._queues:
                        self._sent.append(_Sent(len(self._queues), None, wants_reply=False))
                        await self._send([(self._subscribe, *self._queues)])
                    self._up.set()
            except (RedisConnectionError, RedisTimeoutError, OSError) as again:
                exc = again
                continue
            break
        for held in self._queues.values():
            for queue in held:
                queue.put_nowait(RECONNECTED)

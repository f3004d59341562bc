"""Broker: every Redis command the worker sends, behind one small API."""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError, ResponseError

from exlq.protocol.batch_script import reply_pairs
from exlq.protocol.command_packing import pack_in_c
from exlq.protocol.heartbeat import last_seen
from exlq.protocol.keys import CONSUMER_GROUP, LANES, Lane, QueueKeys, entry_ref, split_entry_ref
from exlq.protocol.slot_routing import follow_slot
from exlq.worker.broker_scripts import COMMIT_LUA, LOST_LUA, RENEW_LUA, START_MANY_LUA, TAKE_LUA
from exlq.worker.commit_batch import MAX_CALL_BYTES, Batch
from exlq.worker.lanes import TakePlan
from exlq.worker.redis_refusals import refusal_in

log = logging.getLogger(__name__)

# An entry longer than the worker's limit comes back as its first this many bytes: enough
# for its id (the SDK writes it first) and for the dead-letter entry that shows what it was.
ENTRY_HEAD_BYTES = 16 * 1024
# And its last this many bytes: where a producer that writes the id last puts it.
ENTRY_TAIL_BYTES = 512
# How long the commit markers outlive the queue's last write: a batch is sent again only
# while Redis is away, and a worker retries its batch until Redis is back. A stopped
# worker's marker goes with its consumer (Broker.leave, forget_idle_consumers).
COMMIT_MARKER_TTL_S = 24 * 3600


@dataclass(frozen=True, slots=True)
class StreamEntry:
    entry_id: str  # the entry's id in its lane's stream, with the lane (keys.entry_ref)
    payload: bytes | None  # the ``job`` field (its head if too long); None when it has none
    # The ``more`` field is 1: its producer is writing more of the same burst right behind
    # it (exlq.producer.submit_batch); a hint to wait for them, never needed to run the job.
    more: bool = False
    size: int = -1  # the ``job`` field's full length in bytes (-1: none)
    # This host's clock when the command that gave the entry to this worker went out: its
    # idle time in Redis counts from later than that.
    claimed_at: float = 0.0
    tail: bytes | None = None  # the last ENTRY_TAIL_BYTES of a payload cut to its head

    @property
    def enqueued_at_server(self) -> float:
        """Unix time (Redis server clock) at which XADD created the entry."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0

    @property
    def lane(self) -> Lane:
        return split_entry_ref(self.entry_id)[1]


@dataclass(frozen=True, slots=True)
class Read:
    """What one read brought, and whether more may be waiting behind it."""

    entries: list[StreamEntry]
    complete: bool  # False: it stopped at a count, and more may have landed


@dataclass(frozen=True, slots=True)
class StartDecision:
    verdict: str  # run | cancel | ended | duplicate | error
    detail: str  # the attempt, the ended state, the other entry, or Redis's error

    @property
    def attempt(self) -> int:
        return int(self.detail) if self.verdict == "run" else 0


class Broker:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: QueueKeys,
        consumer: str,
        *,
        result_ttl_s: int,
        dead_max_len: int,
        max_entry_bytes: int = 1_000_000,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.dead_max_len = dead_max_len
        self.max_entry_bytes = max_entry_bytes
        self.groups_recreated = 0
        # Redis has SPUBLISH (found at start): else a request of wire version 2 is refused.
        self.sharded_pubsub = True
        # The brokers of the queue's partitions, this one first (worker/partitions.py).
        self.parts: list[Broker] = [self]
        # The lanes' streams, in LANES order: the take script's KEYS.
        self.streams = [keys.lane_jobs(lane) for lane in LANES]
        self._start = client.register_script(START_MANY_LUA)
        self._take_script = client.register_script(TAKE_LUA)
        self._commit = client.register_script(COMMIT_LUA)
        self._renew = client.register_script(RENEW_LUA)
        self._lost = client.register_script(LOST_LUA)
        # Names each batch uniquely across restarts of a worker of the same consumer name.
        self._batch_names = (f"{secrets.token_hex(8)}:{n}" for n in itertools.count())

    @classmethod
    def from_url(cls, url: str, keys: QueueKeys, consumer: str, **options: Any) -> Broker:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=15)
        follow_slot(client.connection_pool, keys.jobs)  # the queue's node of a cluster
        pack_in_c(client.connection_pool)
        return cls(client, keys, consumer, **options)

    async def find_sharded_pubsub(self) -> None:
        """Whether this Redis has sharded pub/sub (SPUBLISH, Redis >= 7), for requests of
        wire version 2. A user the ACL denies INFO is taken to have it."""
        try:
            info = await self.client.info("server")
        except ResponseError:
            return
        major = str(info.get("redis_version", "7")).split(".", 1)[0]
        self.sharded_pubsub = not major.isdigit() or int(major) >= 7

    async def close(self) -> None:
        await self.client.aclose()

    async def ping(self) -> None:
        await self.client.ping()

    async def clock_offset_s(self) -> float:
        """Redis server clock minus this host's clock, to time jobs from their entry ids."""
        before = time.time()
        seconds, micros = await self.client.time()
        after = time.time()
        return seconds + micros / 1e6 - (before + after) / 2

    async def ensure_group(self) -> None:
        """The consumer group on every lane's stream."""
        for stream in self.streams:
            try:
                await self.client.xgroup_create(stream, CONSUMER_GROUP, id="0", mkstream=True)
            except ResponseError as exc:
                if "BUSYGROUP" not in str(exc):
                    raise

    async def _group_back(self, exc: ResponseError) -> None:
        """Redis answered NOGROUP: the stream or its consumer group is gone (a restart
        without persistence, a flush, a deleted key). Create the group again, from the
        stream's start, so that what producers add from now on is served; re-raise any
        other error."""
        if "NOGROUP" not in str(exc):
            raise exc
        self.groups_recreated += 1
        log.warning(
            "the consumer group of queue %r is gone (%s): Redis lost its data, or the key was "
            "deleted; creating it again. Jobs Redis held are lost; run Redis with "
            "appendonly yes to keep them",
            self.keys.queue,
            exc,
        )
        await self.ensure_group()

    async def read(self, plan: TakePlan, block_ms: int | None) -> Read:
        """Up to ``plan.total`` new entries, from the lanes as the plan says
        (worker/lanes.py). When none is waiting, wait up to ``block_ms`` (None: no wait) for
        the first of each lane the plan reads, as many lanes as it has slots for, which
        come alone, and take what landed with them: the rest comes through the take script,
        which never hands over more than ENTRY_HEAD_BYTES of an entry over the size limit.
        So a read holds at most one whole entry per lane, however large."""
        entries, _ = await self._take_read(plan)
        waits_on = plan.lanes()[: plan.total]
        if entries or block_ms is None or not waits_on:
            return Read(entries, complete=len(entries) < plan.total)
        claimed_at = time.time()
        rest_plan = plan.after_wait(waits_on)
        # One round trip: Redis runs the script as soon as the blocking read returns, so
        # what landed with the first entry (a burst written at once) comes in the same
        # reply, as a blocking read of the whole count would have brought it.
        async with self.client.pipeline(transaction=False) as pipe:
            streams: dict[Any, Any] = {self.keys.lane_jobs(lane): ">" for lane in waits_on}
            pipe.xreadgroup(CONSUMER_GROUP, self.consumer, streams, count=1, block=block_ms)
            if rest_plan.total > 0:
                args = self._take_args("read", rest_plan.total, steps=rest_plan.steps)
                await self._take_script(keys=self.streams, args=args, client=pipe)
            # Each reply on its own: an entry the blocking read brought is this worker's
            # now, whatever became of the script behind it (Redis may have lost its scripts
            # while the read waited), and must not be dropped with the script's error.
            first, *rest = await pipe.execute(raise_on_error=False)
        if isinstance(first, ResponseError):
            await self._group_back(first)
            return Read([], complete=True)
        if isinstance(first, Exception):
            raise first
        # RESP2 replies (the client's default): [(stream, [(entry_id, fields), ...])]
        messages = cast("list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]]", first or [])
        entries = [
            self._entry(entry_id, fields, claimed_at, self._lane_of(stream))
            for stream, taken in messages
            for entry_id, fields in taken
        ]
        complete = False  # unless the take behind the wait brought less than it could
        if entries and rest and not isinstance(rest[0], Exception):
            followed = self._taken(rest[0], claimed_at, LANES)[0]
            entries += followed
            complete = len(followed) < rest_plan.total
        return Read(entries, complete=complete)

    def _lane_of(self, stream: bytes | str) -> Lane:
        return LANES[self.streams.index(_text(stream))]

    def _entry(
        self, entry_id: bytes, fields: dict[bytes, bytes], claimed_at: float, lane: Lane
    ) -> StreamEntry:
        """An entry the blocking read brought whole: cut to its head, as the take script
        would, if it is over the limit, so that the whole is freed at once."""
        payload = fields.get(b"job")
        size = -1 if payload is None else len(payload)
        tail = None
        if payload is not None and size > self.max_entry_bytes:
            payload, tail = payload[:ENTRY_HEAD_BYTES], payload[-ENTRY_TAIL_BYTES:]
        more = fields.get(b"more") == b"1"
        ref = entry_ref(entry_id.decode(), lane)
        return StreamEntry(ref, payload, more, size, claimed_at, tail)

    async def _take_read(self, plan: TakePlan) -> tuple[list[StreamEntry], str]:
        """Entries the take script reads by ``plan``, without waiting."""
        args = self._take_args("read", plan.total, steps=plan.steps)
        return await self._take(self.streams, LANES, args)

    async def _take(
        self, streams: list[str], lanes: tuple[Lane, ...], args: list[str | int]
    ) -> tuple[list[StreamEntry], str]:
        """Entries read or claimed by the take script from ``streams`` (of ``lanes``), and
        the cursor to go on from."""
        claimed_at = time.time()
        try:
            reply = await self._take_script(keys=streams, args=args)
        except ResponseError as exc:
            await self._group_back(exc)
            return [], "0-0"
        return self._taken(reply, claimed_at, lanes)

    def _take_args(
        self,
        how: str,
        count: int,
        cursor: str = "0-0",
        min_idle_ms: int = 0,
        steps: tuple[tuple[Lane, int], ...] = (),
    ) -> list[str | int]:
        """The take script's ARGV (broker_scripts.TAKE_LUA)."""
        limits: list[str | int] = [self.max_entry_bytes, cursor, ENTRY_HEAD_BYTES, min_idle_ms]
        limits.append(ENTRY_TAIL_BYTES)
        plan = [x for lane, cap in steps for x in (LANES.index(lane) + 1, cap)]
        return [how, CONSUMER_GROUP, self.consumer, count, *limits, *plan]

    def _taken(
        self, reply: Any, claimed_at: float, lanes: tuple[Lane, ...]
    ) -> tuple[list[StreamEntry], str]:
        """The take script's reply as entries, and its cursor."""
        rows = cast("list[Any]", reply)
        next_cursor, rows = _text(rows[0]), rows[1:]
        entries = [
            StreamEntry(
                entry_ref(_text(entry_id), lanes[int(lane) - 1]),
                payload,
                more == b"1",
                int(size),
                claimed_at,
                tail,
            )
            for lane, entry_id, payload, more, size, tail in zip(
                rows[::6], rows[1::6], rows[2::6], rows[3::6], rows[4::6], rows[5::6], strict=True
            )
        ]
        return entries, next_cursor

    async def start_jobs(self, starts: list[tuple[str, str]]) -> list[StartDecision]:
        """For each (job_id, entry_id), decide whether to run it and count the attempt."""
        if not starts:
            return []
        keys = [self.keys.job(job_id) for job_id, _ in starts]
        args: list[str | int] = [self.consumer, self.result_ttl_s]
        args += [entry_id for _, entry_id in starts]
        reply = await self._start(keys=keys, args=args)
        decisions = [StartDecision(verdict, detail) for verdict, detail in reply_pairs(reply)]
        for decision in decisions:
            # A job's state key that fails it is the job's to answer for; this worker's ACL
            # refusing the script's commands is the worker's: its entries stay pending.
            if decision.verdict == "error" and refusal_in(decision.detail):
                raise NoPermissionError(decision.detail)
        return decisions

    async def commit(self, batch: Batch, whole: Batch | None = None) -> list[tuple[str, str]]:
        """Write a batch; returns (entry, reason) for the entries whose events or final were
        not written: 'taken' (another worker owns it now), 'gone' (Redis no longer holds it
        pending) or 'error: ...' (Redis refused a final's writes). Sent again after a lost
        reply, a batch publishes nothing twice: a call Redis ran is answered from this
        worker's marker (broker_scripts.COMMIT_LUA), and a batch too large for one call,
        which goes as several in order, sends again only the calls not answered."""
        whole = whole or batch
        if batch.name is None:
            batch.name = next(self._batch_names)
        if batch.name in whole.answered:
            return whole.answered[batch.name]
        script_keys, body = batch.encode(self.keys)
        if len(body) > MAX_CALL_BYTES and len(batch) > 1:
            first, second = batch.halves()
            return [*await self.commit(first, whole), *await self.commit(second, whole)]
        reply = await self._commit(
            keys=[self.keys.jobs, self.keys.dead, self.keys.commits, self.streams[1], *script_keys],
            args=[
                CONSUMER_GROUP,
                self.consumer,
                self.result_ttl_s,
                self.dead_max_len,
                batch.lease_until_ms,
                body,
                batch.name,
                COMMIT_MARKER_TTL_S,
                self.keys.base,
            ],
        )
        whole.answered[batch.name] = reply_pairs(reply)
        return whole.answered[batch.name]

    @property
    def reserved_slots(self) -> int:
        """Slots a read in flight may still fill (partitions.PartitionedBroker); none here,
        where every read is awaited."""
        return 0

    async def finish_reads(self) -> list[StreamEntry]:
        """What the reads still in flight bring, once they end (partitions); none here."""
        return []

    def keys_of(self, entry_id: str) -> QueueKeys:
        """The keys of the partition that entry ``entry_id`` came from: the queue's own."""
        return self.keys

    async def announce_lost(
        self, job_id: str, entry_id: str, channel: str, event_json: str
    ) -> bool:
        """Publish the event that tells a job's subscribers Redis lost it, unless its state
        exists again; True if published. ``entry_id``: the job's entry, for its partition."""
        published = await self._lost(
            keys=[self.keys.job(job_id)], args=[channel, event_json, self.keys.base]
        )
        return bool(published)

    async def renew(self, jobs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """Reset the idle time of the entries this worker runs, given as (job_id,
        entry_id), and the TTL of their jobs' state; returns (entry, 'taken' or 'gone')
        for those it no longer owns."""
        if not jobs:
            return []
        lost = await self._renew(
            keys=[*self.streams, *(self.keys.job(job_id) for job_id, _ in jobs)],
            args=[CONSUMER_GROUP, self.consumer, self.result_ttl_s, *(e for _, e in jobs)],
        )
        return reply_pairs(lost)

    async def reclaim(self, count: int, min_idle_ms: int) -> list[StreamEntry]:
        """Take over up to ``count`` entries whose owner stopped renewing them, the
        interactive lane's first (XAUTOCLAIM is one atomic command: no two workers take the
        same entry)."""
        taken: list[StreamEntry] = []
        for lane, stream in zip(LANES, self.streams, strict=True):
            cursor = "0-0"
            while len(taken) < count:
                args = self._take_args("claim", count - len(taken), cursor, min_idle_ms)
                entries, cursor = await self._take([stream], (lane,), args)
                taken += entries
                if cursor == "0-0":
                    break
        return taken

    async def cancel_flags(self, jobs: list[tuple[str, str]]) -> list[str]:
        """Which of these jobs, given as (job_id, entry_id), a producer has asked to cancel
        (covers a missed pub/sub)."""
        if not jobs:
            return []
        pipe = self.client.pipeline(transaction=False)
        for job_id, _ in jobs:
            pipe.hget(self.keys.job(job_id), "cancel")
        flags = await pipe.execute()
        return [job_id for (job_id, _), flag in zip(jobs, flags, strict=True) if flag == b"1"]

    async def trim(self) -> int:
        """Drop stream entries that every consumer group has delivered and acknowledged;
        returns how many. Never drops an entry some group has not finished. A stream
        Redis no longer holds has nothing to trim (the reader creates it again)."""
        trimmed = 0
        for stream in self.streams:
            trimmed += await self._trim(stream)
        return trimmed

    async def _trim(self, stream: str) -> int:
        try:
            groups = await self.client.xinfo_groups(stream)
        except ResponseError as exc:
            if _no_stream(exc):
                return 0
            raise
        if not groups:
            return 0
        keep_from: list[tuple[int, int]] = []
        for group in groups:
            name = group["name"]
            pending = await self.client.xpending(stream, name)
            if pending["pending"]:
                keep_from.append(_parse_id(pending["min"]))
            else:
                ms, seq = _parse_id(group["last-delivered-id"])
                keep_from.append((ms, seq + 1))
        ms, seq = min(keep_from)
        if (ms, seq) <= (0, 1):
            return 0
        return int(await self.client.xtrim(stream, minid=f"{ms}-{seq}"))

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        """Delete consumers that hold nothing in any lane and were idle this long in each
        lane's group, and their commit markers; returns how many."""
        seen: dict[str, bool] = {}  # consumer name: whether it may go
        for stream in self.streams:
            try:
                consumers = await self.client.xinfo_consumers(stream, CONSUMER_GROUP)
            except ResponseError as exc:
                if _no_stream(exc):
                    continue
                raise
            for consumer in consumers:
                name = _text(consumer["name"])
                idle = not consumer["pending"] and consumer["idle"] > idle_ms
                seen[name] = seen.get(name, True) and idle and name != self.consumer
        gone = [name for name, may_go in seen.items() if may_go]
        for name in gone:
            for stream in self.streams:
                with contextlib.suppress(ResponseError):
                    await self.client.xgroup_delconsumer(stream, CONSUMER_GROUP, name)
            await self.client.hdel(self.keys.commits, name)
        return len(gone)

    async def cancel_requests(self) -> AsyncIterator[str]:
        """Job ids as cancellation requests arrive on the queue's cancel channel."""
        pubsub = self.client.pubsub(ignore_subscribe_messages=True)
        await pubsub.subscribe(self.keys.cancel)
        try:
            async for message in pubsub.listen():
                data = message.get("data")
                if isinstance(data, bytes):
                    yield data.decode(errors="replace")
        finally:
            await pubsub.aclose()  # type: ignore[no-untyped-call]

    async def heartbeat(self, info: dict[str, Any], stale_after_s: float) -> None:
        now = time.time()
        info = {**info, "last_seen": now}
        pipe = self.client.pipeline(transaction=False)
        pipe.hset(self.keys.workers, self.consumer, json.dumps(info))
        pipe.expire(self.keys.workers, max(int(stale_after_s * 10), 60))
        pipe.hgetall(self.keys.workers)
        *_, workers = await pipe.execute()
        stale = [name for name, raw in workers.items() if last_seen(raw) < now - stale_after_s]
        if stale:
            await self.client.hdel(self.keys.workers, *stale)

    async def leave(self) -> None:
        """A worker that stops: its heartbeat and its commit marker go."""
        pipe = self.client.pipeline(transaction=False)
        pipe.hdel(self.keys.workers, self.consumer)
        pipe.hdel(self.keys.commits, self.consumer)
        await pipe.execute()


def _parse_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _no_stream(exc: ResponseError) -> bool:
    """Redis's answer about a stream or consumer group it does not hold."""
    message = str(exc)
    return "NOGROUP" in message or "no such key" in message.lower()


def _text(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else str(raw)

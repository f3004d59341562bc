"""Broker: every Redis command the worker sends, behind one small API."""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from pydantic_core import to_json
from redis.exceptions import ResponseError

from exlq.protocol.batch_script import per_job_script, reply_pairs
from exlq.protocol.command_packing import pack_in_c
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys

# One engine step's writes. KEYS: jobs stream, dead stream, then the result and job keys of
# each final that names a job (its "k" is the index of its result key: every key a script
# touches is declared, as Redis Cluster and ACLs expect). ARGV: group, consumer, result TTL,
# dead stream cap, unused, the batch as JSON. Returns the entries this worker no longer owns
# (their finals were not written).
_COMMIT_LUA = """
local batch = cjson.decode(ARGV[6])
if batch.publish then
  for _, p in ipairs(batch.publish) do redis.call('PUBLISH', p[1], p[2]) end
end
local lost = {}
if not batch.finals then return lost end
for _, f in ipairs(batch.finals) do
  local owner = redis.call('XPENDING', KEYS[1], ARGV[1], f.entry, f.entry, 1)[1]
  local job = f.k and KEYS[f.k + 1]
  local other = f.guard and redis.call('HGET', job, 'entry')
  if owner == nil or owner[2] ~= ARGV[2] then
    if not f.noack then table.insert(lost, f.entry) end
  else
    if other and other ~= f.entry then
      -- A rejected entry naming another entry's job: leave that job's result and events be.
      f.result = nil
      f.event = nil
    end
    if f.result then
      redis.call('SET', KEYS[f.k], f.result, 'EX', ARGV[3])
      redis.call('HSET', job, 'state', f.state, 'worker', ARGV[2])
      redis.call('EXPIRE', job, ARGV[3])
    end
    if f.dead then
      redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[4], '*', unpack(f.dead))
    end
    if f.event then redis.call('PUBLISH', f.channel, f.event) end
    if not f.noack then redis.call('XACK', KEYS[1], ARGV[1], f.entry) end
  end
end
return lost
"""

# Renew this worker's claim on entries it still owns (resets their idle time) and the TTL
# of their jobs' state hashes, and report the ones another worker has taken: never take an
# entry back from its new owner. The start script gives a job's hash the result TTL; a run
# longer than that would lose the hash mid-run, and with it the cancel flag and the count
# of attempts (a retry would count from 1 again, and subscribers would drop its events as
# an earlier attempt's). KEYS[1] is the jobs stream, KEYS[1 + i] job i's hash; ARGV: group,
# consumer, state TTL, then entry i at ARGV[3 + i].
_RENEW_LUA = """
local lost = {}
for i = 4, #ARGV do
  local owner = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)[1]
  if owner ~= nil and owner[2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    redis.call('EXPIRE', KEYS[i - 2], ARGV[3])
  else
    table.insert(lost, ARGV[i])
  end
end
return lost
"""

# Runs when a worker takes entries: for each, skip jobs that ended or were cancelled,
# count the attempt and record who runs it, atomically so two entries of one id never both
# run. KEYS[i] is job i's state hash, ARGV[2 + i] its entry; ARGV[1] the consumer, ARGV[2]
# the state TTL.
_START_MANY_LUA = per_job_script(
    """
local function start(job, entry_id)
  local state = redis.call('HGET', job, 'state')
  if state == 'done' or state == 'failed' or state == 'cancelled' or state == 'expired' then
    return {'ended', state}
  end
  local entry = redis.call('HGET', job, 'entry')
  if entry and entry ~= entry_id then return {'duplicate', entry} end
  if redis.call('HGET', job, 'cancel') == '1' then return {'cancel', '0'} end
  local attempts = redis.call('HINCRBY', job, 'attempts', 1)
  redis.call('HSET', job, 'state', 'running', 'worker', ARGV[1], 'entry', entry_id)
  redis.call('EXPIRE', job, ARGV[2])
  return {'run', tostring(attempts)}
end""",
    "start",
    first_key=1,
    arg_offset=2,
)


@dataclass(frozen=True, slots=True)
class StreamEntry:
    entry_id: str
    payload: bytes | None  # the ``job`` field; None when the entry has none
    # The ``more`` field is 1: its producer is writing more of the same burst right behind
    # it (exlq.producer.submit_batch); a hint to wait for them, never needed to run the job.
    more: bool = False

    @property
    def enqueued_at_server(self) -> float:
        """Unix time (Redis server clock) at which XADD created the entry."""
        return int(self.entry_id.split("-", 1)[0]) / 1000.0


@dataclass(frozen=True, slots=True)
class StartDecision:
    verdict: str  # run | cancel | ended | duplicate | error
    detail: str  # the attempt, the ended state, the other entry, or Redis's error

    @property
    def attempt(self) -> int:
        return int(self.detail) if self.verdict == "run" else 0


@dataclass(frozen=True, slots=True)
class Final:
    """How one entry ends: its result, its last event, perhaps a dead-letter entry, the ack."""

    entry_id: str
    job_id: str | None = None
    state: str | None = None
    result_json: str | None = None
    channel: str | None = None
    event_json: str | None = None
    dead: dict[str, str] | None = None
    # Write the result and event only if the job's hash names this entry or no entry: a
    # malformed entry must not overwrite another entry's job of the same id.
    guard: bool = False
    # False for all but the last of several finals of one entry (a rejected entry that
    # names two ids answers both): the entry is acked once, and only while it is still
    # owned, so the others go before the one that acks it.
    ack: bool = True


@dataclass
class Batch:
    """Writes gathered from one or more engine steps, sent in one atomic script call.

    Token events go out first, in order. Each final is written only if this worker still
    owns the entry (a worker that lost its claim during an outage must not write a second
    result), and its result, final event and ack are written together."""

    publishes: list[tuple[str, str]] = field(default_factory=list)
    finals: list[Final] = field(default_factory=list)

    def publish(self, channel: str, event_json: str) -> None:
        self.publishes.append((channel, event_json))

    def finish(self, final: Final) -> None:
        self.finals.append(final)

    def __len__(self) -> int:
        return len(self.publishes) + len(self.finals)

    def encode(self, keys: QueueKeys) -> tuple[list[str], bytes]:
        """The script's KEYS and its batch argument (JSON, by pydantic's writer: faster than
        json.dumps for a step's token events)."""
        script_keys = [keys.jobs, keys.dead]
        finals = []
        for f in self.finals:
            # Absent, never null: cjson decodes null to a value Lua treats as true.
            final: dict[str, Any] = {"entry": f.entry_id}
            if f.job_id is not None:
                final["k"] = len(script_keys) + 1  # Lua counts from 1
                script_keys += [keys.result(f.job_id), keys.job(f.job_id)]
            for name, value in (
                ("state", f.state),
                ("result", f.result_json),
                ("channel", f.channel),
                ("event", f.event_json),
                ("dead", _flat(f.dead)),
                ("guard", f.guard or None),
                ("noack", None if f.ack else True),
            ):
                if value is not None:
                    final[name] = value
            finals.append(final)
        body: dict[str, Any] = {}
        if self.publishes:
            body["publish"] = [[channel, event] for channel, event in self.publishes]
        if finals:
            body["finals"] = finals
        return script_keys, to_json(body)


def _flat(fields: dict[str, str] | None) -> list[str] | None:
    return None if fields is None else [x for pair in fields.items() for x in pair]


class Broker:
    def __init__(
        self,
        client: aioredis.Redis,
        keys: QueueKeys,
        consumer: str,
        *,
        result_ttl_s: int,
        dead_max_len: int,
    ) -> None:
        self.client = client
        self.keys = keys
        self.consumer = consumer
        self.result_ttl_s = result_ttl_s
        self.dead_max_len = dead_max_len
        self._start = client.register_script(_START_MANY_LUA)
        self._commit = client.register_script(_COMMIT_LUA)
        self._renew = client.register_script(_RENEW_LUA)

    @classmethod
    def from_url(cls, url: str, keys: QueueKeys, consumer: str, **options: Any) -> Broker:
        client = aioredis.Redis.from_url(url, socket_connect_timeout=5, health_check_interval=15)
        pack_in_c(client.connection_pool)
        return cls(client, keys, consumer, **options)

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
        try:
            await self.client.xgroup_create(self.keys.jobs, CONSUMER_GROUP, id="0", mkstream=True)
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise

    async def read(self, count: int, block_ms: int | None) -> list[StreamEntry]:
        """Up to ``count`` new entries; wait up to ``block_ms`` for the first (None: no wait)."""
        # RESP2 replies (the client's default): [(stream, [(entry_id, fields), ...])]
        reply = cast(
            "list[tuple[bytes, list[tuple[bytes, dict[bytes, bytes]]]]] | None",
            await self.client.xreadgroup(
                CONSUMER_GROUP, self.consumer, {self.keys.jobs: ">"}, count=count, block=block_ms
            ),
        )
        entries: list[StreamEntry] = []
        for _stream, messages in reply or []:
            for entry_id, fields in messages:
                entries.append(
                    StreamEntry(entry_id.decode(), fields.get(b"job"), fields.get(b"more") == b"1")
                )
        return entries

    async def start_jobs(self, starts: list[tuple[str, str]]) -> list[StartDecision]:
        """For each (job_id, entry_id), decide whether to run it and count the attempt."""
        if not starts:
            return []
        keys = [self.keys.job(job_id) for job_id, _ in starts]
        args: list[str | int] = [self.consumer, self.result_ttl_s]
        args += [entry_id for _, entry_id in starts]
        reply = await self._start(keys=keys, args=args)
        return [StartDecision(verdict, detail) for verdict, detail in reply_pairs(reply)]

    async def commit(self, batch: Batch) -> list[str]:
        """Write a batch atomically; returns the entries whose finals were not written
        because another worker owns them now."""
        script_keys, body = batch.encode(self.keys)
        lost = await self._commit(
            keys=script_keys,
            args=[CONSUMER_GROUP, self.consumer, self.result_ttl_s, self.dead_max_len, "", body],
        )
        return [entry.decode() for entry in lost]

    async def renew(self, jobs: list[tuple[str, str]]) -> list[str]:
        """Reset the idle time of the entries this worker runs, given as (job_id,
        entry_id), and the TTL of their jobs' state; returns the entries it lost."""
        if not jobs:
            return []
        lost = await self._renew(
            keys=[self.keys.jobs, *(self.keys.job(job_id) for job_id, _ in jobs)],
            args=[CONSUMER_GROUP, self.consumer, self.result_ttl_s, *(e for _, e in jobs)],
        )
        return [entry.decode() for entry in lost]

    async def reclaim(self, count: int, min_idle_ms: int) -> list[StreamEntry]:
        """Take over up to ``count`` entries whose owner stopped renewing them (XAUTOCLAIM
        is one atomic command: no two workers take the same entry)."""
        taken: list[StreamEntry] = []
        cursor = "0-0"
        while len(taken) < count:
            reply = await self.client.xautoclaim(
                self.keys.jobs,
                CONSUMER_GROUP,
                self.consumer,
                min_idle_ms,
                start_id=cursor,
                count=count - len(taken),
            )
            cursor = reply[0].decode() if isinstance(reply[0], bytes) else str(reply[0])
            for item in reply[1]:
                if item is None:  # deleted while pending (Redis 6.2 reports it so)
                    continue
                entry_id, fields = item[0], item[1]
                payload = _field(fields, b"job") if fields else None
                taken.append(StreamEntry(entry_id.decode(), payload))
            if cursor == "0-0":
                break
        return taken

    async def cancel_flags(self, job_ids: list[str]) -> list[str]:
        """Which of these jobs a producer has asked to cancel (covers a missed pub/sub)."""
        if not job_ids:
            return []
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id), "cancel")
        flags = await pipe.execute()
        return [job_id for job_id, flag in zip(job_ids, flags, strict=True) if flag == b"1"]

    async def trim(self) -> int:
        """Drop stream entries that every consumer group has delivered and acknowledged;
        returns how many. Never drops an entry some group has not finished."""
        groups = await self.client.xinfo_groups(self.keys.jobs)
        if not groups:
            return 0
        keep_from: list[tuple[int, int]] = []
        for group in groups:
            name = group["name"]
            pending = await self.client.xpending(self.keys.jobs, name)
            if pending["pending"]:
                keep_from.append(_parse_id(pending["min"]))
            else:
                ms, seq = _parse_id(group["last-delivered-id"])
                keep_from.append((ms, seq + 1))
        ms, seq = min(keep_from)
        if (ms, seq) <= (0, 1):
            return 0
        return int(await self.client.xtrim(self.keys.jobs, minid=f"{ms}-{seq}"))

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        """Delete consumers of the group that hold nothing and were idle this long."""
        consumers = await self.client.xinfo_consumers(self.keys.jobs, CONSUMER_GROUP)
        gone = 0
        for consumer in consumers:
            name = consumer["name"]
            name = name.decode() if isinstance(name, bytes) else str(name)
            if name != self.consumer and not consumer["pending"] and consumer["idle"] > idle_ms:
                gone += await self.client.xgroup_delconsumer(self.keys.jobs, CONSUMER_GROUP, name)
        return gone

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
        stale = [name for name, raw in workers.items() if _last_seen(raw) < now - stale_after_s]
        if stale:
            await self.client.hdel(self.keys.workers, *stale)

    async def leave(self) -> None:
        await self.client.hdel(self.keys.workers, self.consumer)


def _parse_id(raw: bytes | str) -> tuple[int, int]:
    text = raw.decode() if isinstance(raw, bytes) else raw
    ms, _, seq = text.partition("-")
    return int(ms), int(seq or 0)


def _field(fields: Any, name: bytes) -> bytes | None:
    """A field of an entry, from the flat list XAUTOCLAIM returns or a dict."""
    if isinstance(fields, dict):
        value = fields.get(name)
        return value if isinstance(value, bytes) else None
    pairs = list(fields)
    for key, value in zip(pairs[::2], pairs[1::2], strict=True):
        if key == name:
            return value if isinstance(value, bytes) else None
    return None


def _last_seen(raw: bytes) -> float:
    try:
        return float(json.loads(raw).get("last_seen", 0.0))
    except (ValueError, AttributeError):
        return 0.0

"""What a queue holds, read from Redis alone: each lane's backlog, what workers hold, the dead
letters and the live workers. No worker needs to run; the exporter and `exlq top` read here.

One queue (of one partition) costs one round trip: a pipeline of one read-only Lua script
(every lane's numbers and the dead stream's length, computed server-side, so that no job
payload crosses the network), the HGETALL of the heartbeats and the GET of the partition
count. All keys a script names are one partition's (one hash tag), so the script is valid on
Redis Cluster.

Waiting (the consumer group's lag, entries no worker has read): Redis 7 keeps it in XINFO
GROUPS's ``lag``. Redis 6.2 (the one `exlq up` bundles) has no such field, and Redis 7 gives
nil after deletions inside the stream; then the script counts the entries at or before the
group's last-delivered-id (the stream's head: a worker trims the stream up to its oldest
pending entry, so the head is what workers hold plus what they finished since) and subtracts
them from XLEN. The count stops at ``WAITING_COUNT_CAP`` entries, to bound the time the
script holds Redis: past the cap (a head longer than that: an entry pending for long while
thousands behind it finished, or no trimming), waiting is reported as XLEN minus the cap, an
upper bound, and ``LaneStats.waiting_exact`` is False. Whether anything waits at all is
always exact: it is read from the first entry after the last-delivered-id.

Partitions: a queue split in P partitions (exlq/protocol/keys.py: partition n > 0 has the
hash tag ``{Q/n}``, so that a Redis Cluster may put it on another master) is read as one
queue. The count (``P:{Q}:partitions``, absent: 1) comes with partition 0's numbers; for
P > 1 the script then runs once on each other partition, each on its own slot's node and
all at once (a second round trip), and the numbers are merged: lengths, waiting, pending and
dead letters summed, the oldest ages the oldest of any partition (each measured on its own
node's clock). Keys of partitions name their queue, Q, never a queue "Q/n" of their own; a
dead letter of partition n > 0 is named ``<entry id>#<n>``, as the worker names its entries.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import json
import logging
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoPermissionError

from exlq.protocol.heartbeat import last_seen
from exlq.protocol.keys import CONSUMER_GROUP, LANES, PARTITION_MARK, Lane, QueueKeys
from exlq.protocol.partition_count import parse_count
from exlq.protocol.slot_routing import SlotClients

log = logging.getLogger(__name__)

# The most head entries the Lua path counts per lane and read (see the module's docstring):
# each costs Redis about 2 us (XRANGE builds the entry in Lua), so the cap bounds the
# script's hold on Redis to a few milliseconds.
WAITING_COUNT_CAP = 2_000
# A worker beats every 5 s by default and counts one silent for 6 of those as gone
# (worker/upkeep.py); the SDK's WorkerWatch uses the same bound.
DEFAULT_STALE_AFTER_S = 30.0

# KEYS: each lane's stream, in LANES's order, then the dead stream.
# ARGV: the consumer group, the head-count cap, 1 to count even where XINFO gives a lag.
# Returns one row per lane: {length, has_group (0/1), waiting, waiting_exact (0/1), pending,
# oldest pending id or '', first waiting id or ''}, then the dead stream's length, then
# Redis's TIME.
QUEUE_STATS_LUA = """
local group, cap, force_count = ARGV[1], tonumber(ARGV[2]), ARGV[3] == '1'
local CHUNK = 500

local function count_through(stream, last_id)
  local n, start = 0, '-'
  while n < cap do
    local chunk = redis.call('XRANGE', stream, start, last_id, 'COUNT', math.min(CHUNK, cap - n))
    if #chunk == 0 then return n, true end
    n = n + #chunk
    start = '(' .. chunk[#chunk][1]
  end
  local more = redis.call('XRANGE', stream, start, last_id, 'COUNT', 1)
  return n, #more == 0
end

local function first_id(stream, after)
  local entry = redis.call('XRANGE', stream, after, '+', 'COUNT', 1)[1]
  return entry and entry[1] or ''
end

local function our_group(stream)
  local ok, groups = pcall(redis.call, 'XINFO', 'GROUPS', stream)
  if not ok then return nil end
  for _, flat in ipairs(groups) do
    local info = {}
    for i = 1, #flat, 2 do info[flat[i]] = flat[i + 1] end
    if info['name'] == group then return info end
  end
  return nil
end

local function lane(stream)
  local length = redis.call('XLEN', stream)
  local info = our_group(stream)
  if not info then
    -- No worker has created the group yet: every entry waits.
    return {length, 0, length, 1, 0, '', first_id(stream, '-')}
  end
  local last = info['last-delivered-id']
  local pending = redis.call('XPENDING', stream, group)
  local oldest_pending = pending[1] > 0 and pending[2] or ''
  local first_waiting = first_id(stream, '(' .. last)
  local waiting, exact = 0, 1
  if first_waiting ~= '' then
    local lag = info['lag']
    if type(lag) == 'number' and not force_count then
      waiting = lag
    else
      local head, complete = count_through(stream, last)
      waiting = math.max(length - head, 1)
      exact = complete and 1 or 0
    end
  end
  return {length, 1, waiting, exact, pending[1], oldest_pending, first_waiting}
end

local rows = {}
for i = 1, #KEYS - 1 do rows[i] = lane(KEYS[i]) end
rows[#rows + 1] = redis.call('XLEN', KEYS[#KEYS])
rows[#rows + 1] = redis.call('TIME')
return rows
"""


@dataclass(frozen=True)
class LaneStats:
    """One lane's stream and what its consumer group has done with it."""

    lane: Lane
    length: int  # entries in the stream (XLEN)
    has_group: bool  # False until a worker has created the consumer group
    waiting: int  # entries no worker has read (the group's lag)
    waiting_exact: bool  # False past WAITING_COUNT_CAP on the counted path
    pending: int  # read by a worker, not yet acked
    oldest_waiting_s: float  # since the oldest waiting entry was added; 0 when none waits
    oldest_pending_s: float  # since the oldest pending entry was added; 0 when none


@dataclass(frozen=True)
class WorkerBeat:
    """One worker's last heartbeat (worker/upkeep.py writes it)."""

    name: str
    engine: str
    model: str | None
    capacity: int
    load: int
    ready: bool
    last_seen: float  # Unix seconds, the worker's clock
    # Over the interval before this heartbeat; None until its second one (or a worker
    # that does not write them).
    jobs_per_s: float | None = None
    tokens_per_s: float | None = None


@dataclass(frozen=True)
class QueueStats:
    """One queue at one moment (Redis's clock)."""

    queue: str
    lanes: tuple[LaneStats, ...]
    dead_letters: int
    workers: tuple[WorkerBeat, ...]  # the live ones only
    redis_time_s: float  # partition 0's node's clock (the heartbeats' node)
    partitions: int = 1  # what the queue is split in; lanes and dead letters sum them all

    @property
    def capacity(self) -> int:
        return sum(worker.capacity for worker in self.workers)

    @property
    def running(self) -> int:
        return sum(worker.load for worker in self.workers)

    @property
    def waiting(self) -> int:
        return sum(lane.waiting for lane in self.lanes)

    @property
    def pending(self) -> int:
        return sum(lane.pending for lane in self.lanes)

    @property
    def jobs_per_s(self) -> float | None:
        """Jobs the live workers ended per second (done or failed), from their heartbeats;
        None where none of them says."""
        return _total(worker.jobs_per_s for worker in self.workers)

    @property
    def tokens_per_s(self) -> float | None:
        return _total(worker.tokens_per_s for worker in self.workers)


class QueueNames:
    """Which queue a key under ``prefix`` belongs to, for finding queues by SCAN: a lane's
    stream, the dead stream, the heartbeats or the partition count name one. A key of
    partition n > 0 (tag ``{Q/n}``) names its queue, Q: a partition is no queue of its own."""

    def __init__(self, prefix: str) -> None:
        mark = re.escape(PARTITION_MARK)
        # The queue's own tag, {Q}, or one of its partitions', {Q/n}: both name Q.
        tag = rf"\{{([^{{}}{mark}]+)(?:{mark}[1-9][0-9]*)?\}}"
        self._pattern = re.compile(
            rf"^{re.escape(prefix)}:{tag}:(?:jobs|jobs:batch|dead|workers|partitions)$"
        )
        # SCAN's arguments: only keys with a hash tag under the prefix, 1,000 a step.
        self.scan: dict[str, Any] = {"match": f"{prefix}:{{*}}:*", "count": 1000}

    def by(self, key: bytes | str) -> str | None:
        match = self._pattern.match(_text(key))
        return match.group(1) if match else None


class QueueReader:
    """Reads queues' stats through one client; the script is loaded once per server."""

    def __init__(
        self,
        client: aioredis.Redis,
        prefix: str,
        *,
        stale_after_s: float = DEFAULT_STALE_AFTER_S,
        count_cap: int = WAITING_COUNT_CAP,
        force_count: bool = False,
    ) -> None:
        self.client = client
        # Each queue's (each partition's) client: on a Redis Cluster, one reaching its master.
        self.clients = SlotClients(client)
        self.prefix = prefix
        self.stale_after_s = stale_after_s
        self.count_cap = count_cap
        # Count the head even where Redis gives the lag (tests compare the two paths).
        self.force_count = force_count
        self._script: AsyncScript = client.register_script(QUEUE_STATS_LUA)
        self._count_denied: set[str] = set()  # queues whose count the ACL denied (warned)

    async def read(self, queue: str) -> QueueStats:
        """One queue's stats, every partition's summed; a queue with no keys yet reads as
        empty, not as an error."""
        keys = QueueKeys(queue, self.prefix)
        pipe = (await self.clients.for_key(keys.jobs)).pipeline(transaction=False)
        await self._stats_script(keys, pipe)
        pipe.hgetall(keys.workers)
        pipe.get(keys.partitions)  # the count's key shares partition 0's slot
        rows, beats, stored_count = await pipe.execute(raise_on_error=False)
        first = _partition_stats(_answer(rows))
        count = self._count_of(queue, stored_count)
        parts = [first, *await self._other_partitions(keys, count)]
        workers = live_workers(_answer(beats), first.redis_time_s - self.stale_after_s)
        return QueueStats(
            queue,
            merge_lanes([part.lanes for part in parts]),
            sum(part.dead_letters for part in parts),
            workers,
            first.redis_time_s,
            count,
        )

    async def read_many(self, queues: Iterable[str]) -> list[QueueStats]:
        return [await self.read(queue) for queue in queues]

    async def discover(self) -> list[str]:
        """Every queue under the prefix with a lane stream, a dead stream, heartbeats or a
        partition count, in any of its partitions; each queue once.
        SCAN walks the whole keyspace (in steps of 1,000 keys): callers cache the answer."""
        named = QueueNames(self.prefix)
        found = {named.by(key) async for key in self.clients.scan_iter(**named.scan)}
        return sorted(queue for queue in found if queue)

    async def recent_dead_letters(
        self, queue: str, count: int, partitions: int | None = None
    ) -> list[DeadLetter]:
        """The newest ``count`` dead letters of a queue, of all its partitions, newest first
        (by entry time; without the job). ``partitions``: the queue's count, where the
        caller has it (QueueStats.partitions); else it is read with partition 0's letters."""
        keys = QueueKeys(queue, self.prefix)
        client = await self.clients.for_key(keys.jobs)
        if partitions is None:
            pipe = client.pipeline(transaction=False)
            pipe.xrevrange(keys.dead, "+", "-", count=count)
            pipe.get(keys.partitions)
            entries, stored_count = await pipe.execute(raise_on_error=False)
            first = _dead_letters(_answer(entries), 0)
            partitions = self._count_of(queue, stored_count)
        else:
            first = _dead_letters(await client.xrevrange(keys.dead, "+", "-", count=count), 0)
        if partitions == 1:
            return first
        others = await asyncio.gather(
            *(self._dead_of(keys.of_partition(n), count) for n in range(1, partitions))
        )
        merged = heapq.merge(first, *others, key=_newest_key, reverse=True)
        return list(itertools.islice(merged, count))

    async def _stats_script(self, keys: QueueKeys, client: aioredis.Redis) -> Any:
        """The stats script on one partition's keys, sent through ``client`` (a pipeline,
        or a partition's client)."""
        return await self._script(
            keys=[*(keys.lane_jobs(lane) for lane in LANES), keys.dead],
            args=[CONSUMER_GROUP, self.count_cap, int(self.force_count)],
            client=client,
        )

    async def _other_partitions(self, keys: QueueKeys, count: int) -> list[PartitionStats]:
        """Partitions 1 to ``count`` - 1, each read on its own slot's node, all at once."""

        async def read(partition: QueueKeys) -> PartitionStats:
            client = await self.clients.for_key(partition.jobs)
            return _partition_stats(await self._stats_script(partition, client))

        return list(await asyncio.gather(*(read(keys.of_partition(n)) for n in range(1, count))))

    async def _dead_of(self, partition: QueueKeys, count: int) -> list[DeadLetter]:
        client = await self.clients.for_key(partition.jobs)
        entries = await client.xrevrange(partition.dead, "+", "-", count=count)
        return _dead_letters(entries, partition.partition)

    def _count_of(self, queue: str, stored: Any) -> int:
        """The queue's partition count from the GET's answer. A user the ACL denies the key
        reads the queue as one partition (as producers then submit: partition_count.py),
        with one warning per queue, rather than losing the whole queue's stats."""
        if not isinstance(stored, NoPermissionError):
            return parse_count(_answer(stored))
        if queue not in self._count_denied:
            self._count_denied.add(queue)
            log.warning("cannot read queue %s's partition count (%s): read as one", queue, stored)
        return 1


@dataclass(frozen=True)
class PartitionStats:
    """What the stats script says of one partition, on its node's clock."""

    lanes: tuple[LaneStats, ...]
    dead_letters: int
    redis_time_s: float


def merge_lanes(parts: Sequence[tuple[LaneStats, ...]]) -> tuple[LaneStats, ...]:
    """Each lane of the queue from that lane of every partition: counts summed, waiting
    exact where every partition's is, the oldest ages the oldest of any partition."""
    if len(parts) == 1:
        return parts[0]
    return tuple(_merged_lane(same_lane) for same_lane in zip(*parts, strict=True))


def _merged_lane(same_lane: Sequence[LaneStats]) -> LaneStats:
    return LaneStats(
        lane=same_lane[0].lane,
        length=sum(part.length for part in same_lane),
        has_group=any(part.has_group for part in same_lane),
        waiting=sum(part.waiting for part in same_lane),
        waiting_exact=all(part.waiting_exact for part in same_lane),
        pending=sum(part.pending for part in same_lane),
        oldest_waiting_s=max(part.oldest_waiting_s for part in same_lane),
        oldest_pending_s=max(part.oldest_pending_s for part in same_lane),
    )


# A dead letter of partition n > 0 is named ``<entry id>#<n>``: two partitions' dead streams
# may hold the same id. (The worker names its entries of partitions so: worker/partitions.py.)
PARTITION_TAG = "#"


def partition_name(entry_id: str, partition: int) -> str:
    """The name of entry ``entry_id`` of ``partition``'s stream: the id itself in partition 0."""
    return f"{entry_id}{PARTITION_TAG}{partition}" if partition else entry_id


def split_partition_name(name: str) -> tuple[str, int] | None:
    """The entry id and the partition a name says (``partition_name``'s inverse); None for a
    name whose partition part is not a number."""
    entry_id, tagged, partition = name.partition(PARTITION_TAG)
    if not tagged:
        return entry_id, 0
    return (entry_id, int(partition)) if partition.isdigit() else None


@dataclass(frozen=True)
class DeadLetter:
    """A job that failed for good, as the worker's dead-letter entry says."""

    entry_id: str  # in its partition's dead stream
    error: str
    message: str
    failed_at: float  # Unix seconds; from the entry id where the field is missing
    worker: str
    partition: int = 0

    @property
    def name(self) -> str:
        """Its name across the queue's partitions (partition_name)."""
        return partition_name(self.entry_id, self.partition)


def live_workers(beats: dict[Any, Any], oldest_s: float) -> tuple[WorkerBeat, ...]:
    """The heartbeats seen at or after ``oldest_s``, by name; unreadable ones are skipped."""
    live = [_beat(_text(name), raw) for name, raw in beats.items() if last_seen(raw) >= oldest_s]
    return tuple(sorted((beat for beat in live if beat), key=lambda beat: beat.name))


def entry_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry id: when Redis added it."""
    return int(_text(entry_id).partition("-")[0])


def entry_order(entry_id: bytes | str) -> tuple[int, int]:
    """A stream entry id as numbers, to order entries of several streams by when they were
    added (milliseconds, then sequence)."""
    ms, _, seq = _text(entry_id).partition("-")
    return int(ms), int(seq or 0)


def _answer(answer: Any) -> Any:
    """A pipeline's answer, run with raise_on_error=False: an error is raised here."""
    if isinstance(answer, Exception):
        raise answer
    return answer


def _partition_stats(rows: Sequence[Any]) -> PartitionStats:
    *lane_rows, dead, (seconds, micros) = rows
    now_s = int(seconds) + int(micros) / 1e6
    lanes = tuple(_lane(lane, row, now_s) for lane, row in zip(LANES, lane_rows, strict=True))
    return PartitionStats(lanes, int(dead), now_s)


def _lane(lane: Lane, row: Sequence[Any], now_s: float) -> LaneStats:
    length, has_group, waiting, exact, pending, oldest_pending, first_waiting = row
    return LaneStats(
        lane=lane,
        length=int(length),
        has_group=bool(has_group),
        waiting=int(waiting),
        waiting_exact=bool(exact),
        pending=int(pending),
        oldest_waiting_s=_age_s(first_waiting, now_s),
        oldest_pending_s=_age_s(oldest_pending, now_s),
    )


def _age_s(entry_id: bytes | str, now_s: float) -> float:
    if not entry_id:
        return 0.0
    return max(now_s - entry_ms(entry_id) / 1000, 0.0)


def _beat(name: str, raw: bytes | str) -> WorkerBeat | None:
    try:
        info = json.loads(raw)
        return WorkerBeat(
            name=name,
            engine=str(info.get("engine") or "?"),
            model=str(info["model"]) if info.get("model") else None,
            capacity=int(info.get("capacity") or 0),
            load=int(info.get("load") or 0),
            ready=bool(info.get("ready", True)),
            last_seen=last_seen(raw),
            jobs_per_s=_rate(info.get("jobs_per_s")),
            tokens_per_s=_rate(info.get("tokens_per_s")),
        )
    except (ValueError, TypeError, AttributeError):
        return None


def _total(rates: Iterable[float | None]) -> float | None:
    known = [rate for rate in rates if rate is not None]
    return sum(known) if known else None


def _rate(value: Any) -> float | None:
    return None if value is None else float(value)


def _dead_letters(entries: Any, partition: int) -> list[DeadLetter]:
    """XREVRANGE's entries of one partition's dead stream as dead letters."""
    return [
        _dead_letter(entry_id, fields or {}, partition)
        for entry_id, fields in entries or []
        if entry_id
    ]


def _newest_key(letter: DeadLetter) -> tuple[int, int]:
    return entry_order(letter.entry_id)


def _dead_letter(entry_id: bytes | str, fields: dict[Any, Any], partition: int) -> DeadLetter:
    text = {_text(key): _text(value) for key, value in fields.items()}
    try:
        failed_at = float(text.get("failed_at", ""))
    except ValueError:
        failed_at = entry_ms(entry_id) / 1000
    return DeadLetter(
        entry_id=_text(entry_id),
        error=text.get("error", "?"),
        message=text.get("message", ""),
        failed_at=failed_at,
        worker=text.get("worker", ""),
        partition=partition,
    )


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)

"""What a queue holds, read from Redis alone: each lane's backlog, what workers hold, the dead
letters and the live workers. No worker needs to run; the exporter and `exlq top` read here.

One queue costs one round trip: a pipeline of one read-only Lua script (every lane's numbers
and the dead stream's length, computed server-side, so that no job payload crosses the
network) and the HGETALL of the heartbeats. All keys named are the queue's (one hash tag), so
the script is valid on Redis Cluster.

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
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript

from exlq.protocol.heartbeat import last_seen
from exlq.protocol.keys import CONSUMER_GROUP, LANES, Lane, QueueKeys
from exlq.protocol.slot_routing import SlotClients

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
    redis_time_s: float

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
    stream, the dead stream or the heartbeats name one."""

    def __init__(self, prefix: str) -> None:
        self._pattern = re.compile(
            rf"^{re.escape(prefix)}:\{{([^{{}}]+)\}}:(?:jobs|jobs:batch|dead|workers)$"
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
        # Each queue's client: on a Redis Cluster, one reaching the queue's master.
        self.clients = SlotClients(client)
        self.prefix = prefix
        self.stale_after_s = stale_after_s
        self.count_cap = count_cap
        # Count the head even where Redis gives the lag (tests compare the two paths).
        self.force_count = force_count
        self._script: AsyncScript = client.register_script(QUEUE_STATS_LUA)

    async def read(self, queue: str) -> QueueStats:
        """One queue's stats; a queue with no keys yet reads as empty, not as an error."""
        keys = QueueKeys(queue, self.prefix)
        pipe = (await self.clients.for_key(keys.jobs)).pipeline(transaction=False)
        await self._script(
            keys=[*(keys.lane_jobs(lane) for lane in LANES), keys.dead],
            args=[CONSUMER_GROUP, self.count_cap, int(self.force_count)],
            client=pipe,
        )
        pipe.hgetall(keys.workers)
        rows, beats = await pipe.execute()
        *lane_rows, dead, (seconds, micros) = rows
        now_s = int(seconds) + int(micros) / 1e6
        lanes = tuple(_lane(lane, row, now_s) for lane, row in zip(LANES, lane_rows, strict=True))
        workers = live_workers(beats, now_s - self.stale_after_s)
        return QueueStats(queue, lanes, int(dead), workers, now_s)

    async def read_many(self, queues: Iterable[str]) -> list[QueueStats]:
        return [await self.read(queue) for queue in queues]

    async def discover(self) -> list[str]:
        """Every queue under the prefix with a lane stream, a dead stream or heartbeats.
        SCAN walks the whole keyspace (in steps of 1,000 keys): callers cache the answer."""
        named = QueueNames(self.prefix)
        found = {named.by(key) async for key in self.clients.scan_iter(**named.scan)}
        return sorted(queue for queue in found if queue)

    async def recent_dead_letters(self, queue: str, count: int) -> list[DeadLetter]:
        """The newest ``count`` dead letters of a queue, newest first (without the job)."""
        keys = QueueKeys(queue, self.prefix)
        client = await self.clients.for_key(keys.jobs)
        entries = await client.xrevrange(keys.dead, "+", "-", count=count)
        return [
            _dead_letter(entry_id, fields or {}) for entry_id, fields in entries or [] if entry_id
        ]


@dataclass(frozen=True)
class DeadLetter:
    """A job that failed for good, as the worker's dead-letter entry says."""

    entry_id: str
    error: str
    message: str
    failed_at: float  # Unix seconds; from the entry id where the field is missing
    worker: str


def live_workers(beats: dict[Any, Any], oldest_s: float) -> tuple[WorkerBeat, ...]:
    """The heartbeats seen at or after ``oldest_s``, by name; unreadable ones are skipped."""
    live = [_beat(_text(name), raw) for name, raw in beats.items() if last_seen(raw) >= oldest_s]
    return tuple(sorted((beat for beat in live if beat), key=lambda beat: beat.name))


def entry_ms(entry_id: bytes | str) -> int:
    """The milliseconds part of a stream entry id: when Redis added it."""
    return int(_text(entry_id).partition("-")[0])


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


def _dead_letter(entry_id: bytes | str, fields: dict[Any, Any]) -> DeadLetter:
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
    )


def _text(raw: bytes | str) -> str:
    return raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)

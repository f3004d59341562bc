"""A queue's dead letters (the stream ``P:{Q}:dead``, written by the worker's commit script):
read them, put their jobs back in their lanes, delete them. Every Redis command of
``exlq dead`` is here; dead_cli.py only talks to the operator.

A replay keeps the job's id, so that ``exlq result``/``status`` and a client waiting on the
id see the rerun. The SDK's submit would refuse it (it dedupes on the job's state hash, which
also counts the attempts the worker's start script adds to), so the replay is one script of
its own: check, enqueue to the job's lane, reset the state hash (attempts 0: the next start
is attempt 1; no cancel flag), delete the old result, and only then delete the dead letter.

A queue split in partitions (exlq/protocol/keys.py) has a dead stream in each, ``P:{Q/n}:dead``
for partition n > 0, each on its own slot's node (NodeClients). ``DeadStream`` is one
partition's; ``DeadLetters`` is the queue's, every partition's as one: listed newest first
across them, counted and purged in each. A dead letter of partition n > 0 is named
``<entry id>#<n>`` (queue_stats.partition_name), since two partitions' streams may hold the
same id; partition 0's keep their plain ids, so a queue of one partition reads as before. A
replay puts the job back in the partition it died in, where its state hash and result are.
"""

from __future__ import annotations

import heapq
import json
import logging
import re
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import cast

import redis
from redis.crc import key_slot
from redis.exceptions import NoPermissionError, RedisError

from exlq.ops.queue_stats import QueueNames, entry_order, partition_name, split_partition_name
from exlq.protocol.keys import Lane, QueueKeys, entry_ref, split_entry_ref
from exlq.protocol.models import InvalidRequest, parse_request
from exlq.protocol.partition_count import parse_count
from exlq.protocol.slot_routing import Address, masters_of, node_client, slot_ranges

log = logging.getLogger(__name__)

_STREAM_ID = re.compile(r"^\d+(-\d+)?$")
# Dead letters read per round trip when one is looked for by job id, or counted.
_PAGE = 500


class DeadLetterError(Exception):
    """What an operator asked for cannot be done; the message says why."""


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead stream, as the worker wrote it."""

    entry_id: str  # its id in its partition's dead stream
    fields: dict[str, str]  # everything the worker wrote
    partition: int = 0  # of the queue: where the job died, and where a replay puts it

    @property
    def name(self) -> str:
        """Its name across the queue's partitions: the entry id, ``#<n>`` after it for
        partition n > 0."""
        return partition_name(self.entry_id, self.partition)

    @property
    def request_json(self) -> str:
        """The request as the worker read it (for an entry it refused, the first bytes)."""
        return self.fields.get("job", "")

    @property
    def job_id(self) -> str | None:
        """The request's id, where the request is a JSON object that has one."""
        try:
            request = json.loads(self.request_json)
        except ValueError:
            return None
        job_id = request.get("id") if isinstance(request, dict) else None
        return job_id if isinstance(job_id, str) else None

    @property
    def failed_at(self) -> float | None:
        """When it was written (Unix seconds): the worker's clock, else the entry id's."""
        try:
            return float(self.fields["failed_at"])
        except (KeyError, ValueError):
            return int(self.entry_id.partition("-")[0]) / 1000

    @property
    def attempts(self) -> int:
        try:
            return int(self.fields.get("attempts", "0"))
        except ValueError:
            return 0

    @property
    def error(self) -> str:
        return self.fields.get("error", "")

    @property
    def message(self) -> str:
        return self.fields.get("message", "")

    @property
    def job_entry(self) -> str:
        """The job's own entry when it failed, as the worker names it (keys.entry_ref)."""
        return self.fields.get("entry", "")

    @property
    def lane(self) -> Lane:
        """The lane the job was in (and a replay puts it back in)."""
        return split_entry_ref(self.job_entry)[1]


@dataclass(frozen=True)
class Replayed:
    """A dead letter's job, queued again under its own id."""

    job_id: str
    entry_id: str  # the new entry in its lane's stream
    lane: Lane
    channel: str  # where its events go
    partition: int = 0  # whose lane stream it is in


@dataclass(frozen=True)
class NotReplayed:
    """A dead letter left as it was, and why."""

    dead_id: str  # the dead letter's name (DeadLetter.name)
    job_id: str | None
    reason: str


ReplayOutcome = Replayed | NotReplayed

# KEYS: the lane's stream, the job's state hash, its result, the dead stream. ARGV: the
# request JSON, the state TTL (s), the lane's mark for the job hash (keys.entry_ref), the
# dead letter's id. Every check comes before the first write (Redis does not roll a script
# back). Returns {'replayed', entry ref} or {refusal, detail}.
REPLAY_LUA = """
if #redis.call('XRANGE', KEYS[4], ARGV[4], ARGV[4]) == 0 then return {'gone', ''} end
local kind = redis.call('TYPE', KEYS[2])['ok']
if kind ~= 'none' and kind ~= 'hash' then return {'unusable', kind} end
local state = redis.call('HGET', KEYS[2], 'state')
if state == 'queued' or state == 'running' or state == 'done' then
  return {state, redis.call('HGET', KEYS[2], 'entry') or ''}
end
local entry = redis.call('XADD', KEYS[1], '*', 'job', ARGV[1]) .. ARGV[3]
redis.call('DEL', KEYS[2], KEYS[3])
redis.call('HSET', KEYS[2], 'state', 'queued', 'entry', entry, 'attempts', 0)
redis.call('EXPIRE', KEYS[2], ARGV[2])
redis.call('XDEL', KEYS[4], ARGV[4])
return {'replayed', entry}
"""

_REFUSALS = {
    "gone": "the dead letter is gone (replayed or purged meanwhile)",
    "unusable": "its state key {job} is a {detail}, not a hash; delete that key first",
    "queued": "the job is queued again already (entry {detail}): replaying would run it twice",
    "running": "the job is running again (entry {detail}): replaying would run it twice",
    "done": "the job is done (a later run succeeded): its result stands",
}


class DeadStream:
    """The dead letters of one partition of a queue (the queue's own keys for partition 0),
    on a synchronous Redis client of the partition's node."""

    def __init__(self, client: redis.Redis, keys: QueueKeys) -> None:
        self.client = client
        self.keys = keys
        self._replay = client.register_script(REPLAY_LUA)

    def count(self) -> int:
        return int(self.client.xlen(self.keys.dead))

    def newest(self, count: int) -> list[DeadLetter]:
        """Up to ``count`` dead letters, newest first."""
        return self._letters(self.client.xrevrange(self.keys.dead, "+", "-", count=count))

    def by_id(self, entry_id: str) -> DeadLetter | None:
        """The dead letter whose entry id is ``entry_id``, if there is one."""
        found = self._letters(self.client.xrange(self.keys.dead, entry_id, entry_id))
        return found[0] if found else None

    def newest_first(self) -> Iterator[DeadLetter]:
        """Every dead letter, newest first, read a page at a time as it is iterated."""
        end = "+"
        while True:
            page = self._letters(self.client.xrevrange(self.keys.dead, end, "-", count=_PAGE))
            yield from page
            if len(page) < _PAGE:
                return
            end = f"({page[-1].entry_id}"

    def replay(self, letter: DeadLetter, state_ttl_s: int) -> ReplayOutcome:
        """Queue ``letter``'s job again in its lane, under its id, as attempt 1."""
        try:
            request = parse_request(letter.request_json)
        except InvalidRequest as exc:
            return NotReplayed(letter.name, letter.job_id, f"its request does not parse: {exc}")
        if request.past_deadline(time.time()):
            reason = "its deadline has passed: it would end expired without running"
            return NotReplayed(letter.name, request.id, reason)
        lane = letter.lane
        reply = self._replay(
            keys=[
                self.keys.lane_jobs(lane),
                self.keys.job(request.id),
                self.keys.result(request.id),
                self.keys.dead,
            ],
            args=[
                letter.request_json,
                state_ttl_s,
                entry_ref("", lane),
                letter.entry_id,
            ],
        )
        verdict, detail = (_text(part) for part in cast("list[object]", reply))
        if verdict == "replayed":
            new_entry = split_entry_ref(detail)[0]
            channel = self.keys.events(request.id)
            return Replayed(request.id, new_entry, lane, channel, self.keys.partition)
        reason = _REFUSALS[verdict].format(job=self.keys.job(request.id), detail=detail)
        return NotReplayed(letter.name, request.id, reason)

    def count_older_than(self, cutoff_ms: int | None) -> int:
        """How many a purge up to ``cutoff_ms`` (Redis time; None: all) would delete."""
        if cutoff_ms is None:
            return self.count()
        total, start = 0, "-"
        while True:
            page = self._letters(
                self.client.xrange(self.keys.dead, start, f"({cutoff_ms}-0", count=_PAGE)
            )
            total += len(page)
            if len(page) < _PAGE:
                return total
            start = f"({page[-1].entry_id}"

    def purge(self, cutoff_ms: int | None) -> int:
        """Delete the dead letters written before ``cutoff_ms`` (None: all); how many went."""
        if cutoff_ms is None:
            pipe = self.client.pipeline(transaction=True)
            pipe.xlen(self.keys.dead)
            pipe.delete(self.keys.dead)
            count, _ = pipe.execute()
            return int(count)
        return int(self.client.xtrim(self.keys.dead, minid=f"{cutoff_ms}-0"))

    def now_ms(self) -> int:
        """Redis's clock: a dead letter's id is its time on it."""
        seconds, micros = self.client.time()
        return int(seconds) * 1000 + int(micros) // 1000

    def _letters(self, raw: object) -> list[DeadLetter]:
        entries = cast("list[tuple[object, dict[object, object]]]", raw)
        partition = self.keys.partition
        return [
            DeadLetter(_text(entry_id), {_text(k): _text(v) for k, v in fields.items()}, partition)
            for entry_id, fields in entries
        ]


class DeadLetters:
    """The dead letters of one queue: every partition's dead stream (``parts[n]`` is
    partition n's), read and written as one."""

    def __init__(self, parts: Sequence[DeadStream]) -> None:
        self.parts = list(parts)
        self.keys = self.parts[0].keys  # the queue's own

    @property
    def partitions(self) -> int:
        return len(self.parts)

    def count(self) -> int:
        return sum(part.count() for part in self.parts)

    def newest(self, count: int) -> list[DeadLetter]:
        """Up to ``count`` dead letters, newest first, of every partition."""
        if len(self.parts) == 1:
            return self.parts[0].newest(count)
        each = (part.newest(count) for part in self.parts)
        return list(heapq.merge(*each, key=_letter_order, reverse=True))[:count]

    def find(self, ident: str) -> DeadLetter:
        """The dead letter named ``ident`` (DeadLetter.name), else the newest whose job's id
        is ``ident``."""
        named = self._named(ident)
        if named is not None:
            return named
        for letter in self._newest_first():
            if letter.job_id == ident:
                return letter
        raise DeadLetterError(
            f"no dead letter {ident!r} in queue {self.keys.queue!r} (neither a dead "
            "letter's id nor a job id among them; exlq dead list shows them)"
        )

    def all(self) -> list[DeadLetter]:
        """Every dead letter, oldest first."""
        return list(reversed(list(self._newest_first())))

    def replay(self, letter: DeadLetter, state_ttl_s: int) -> ReplayOutcome:
        """Queue ``letter``'s job again in its lane of the partition it died in (its state
        hash and result are there), under its id, as attempt 1."""
        return self.parts[letter.partition].replay(letter, state_ttl_s)

    def count_older_than(self, cutoff_ms: int | None) -> int:
        return sum(part.count_older_than(cutoff_ms) for part in self.parts)

    def purge(self, cutoff_ms: int | None) -> int:
        return sum(part.purge(cutoff_ms) for part in self.parts)

    def now_ms(self) -> int:
        """Partition 0's node's clock, the cutoff of a purge of every partition (a cluster
        keeps its nodes' clocks far closer than the durations --older-than takes)."""
        return self.parts[0].now_ms()

    def _named(self, ident: str) -> DeadLetter | None:
        """The dead letter ``ident`` names, if any. A plain entry id is partition 0's name:
        looked for there first, then in the other partitions (an id read off a stream)."""
        split = split_partition_name(ident)
        if split is None or not _STREAM_ID.fullmatch(split[0]):
            return None
        entry_id, partition = split
        where = range(len(self.parts)) if entry_id == ident else [partition]
        for n in where:
            found = self.parts[n].by_id(entry_id) if n < len(self.parts) else None
            if found is not None:
                return found
        return None

    def _newest_first(self) -> Iterator[DeadLetter]:
        """Every partition's dead letters, newest first, each read a page at a time."""
        if len(self.parts) == 1:
            return self.parts[0].newest_first()
        each = (part.newest_first() for part in self.parts)
        return heapq.merge(*each, key=_letter_order, reverse=True)


class NodeClients:
    """(Synchronous.) Clients of the nodes serving keys' slots, made from one client: that
    client itself on a single Redis; on a Redis Cluster, one client per master, shared by
    the keys it serves (a queue's partitions may sit on several), the cluster's slots asked
    once. close() closes the clients it made."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._ranges: list[tuple[int, int, Address]] | None = None
        self._asked = False
        self._made: dict[Address, redis.Redis] = {}

    def for_key(self, key: str) -> redis.Redis:
        ranges = self._slot_ranges()
        if ranges is None:
            return self.client
        slot = key_slot(key.encode())
        address = next((a for first, last, a in ranges if first <= slot <= last), None)
        if address is None:
            raise RedisError(f"no node of the Redis Cluster serves slot {slot} now")
        made = self._made.get(address)
        if made is None:
            made = self._made[address] = node_client(self.client, address)
        return made

    def close(self) -> None:
        for made in self._made.values():
            made.close()
        self._made.clear()

    def _slot_ranges(self) -> list[tuple[int, int, Address]] | None:
        """The cluster's masters by slot range, asked once; None on a single Redis."""
        if not self._asked:
            self._asked = True
            self._ranges = slot_ranges(self.client)
        return self._ranges


def open_dead_letters(nodes: NodeClients, keys: QueueKeys) -> DeadLetters:
    """The dead letters of ``keys``' queue, each partition's through its slot's node."""
    count = _partition_count(nodes.for_key(keys.partitions), keys)
    parts = [keys.of_partition(n) for n in range(count)]
    return DeadLetters([DeadStream(nodes.for_key(part.jobs), part) for part in parts])


def _partition_count(client: redis.Redis, keys: QueueKeys) -> int:
    """The queue's partition count; a user the ACL denies the key is taken to have one
    partition (as producers take it: exlq/protocol/partition_count.py)."""
    try:
        return parse_count(cast("bytes | None", client.get(keys.partitions)))
    except NoPermissionError as exc:
        log.warning("cannot read %s (%s): reading partition 0 only", keys.partitions, exc)
        return 1


def _letter_order(letter: DeadLetter) -> tuple[int, int]:
    """When a dead letter was written, by its entry id: the order across partitions."""
    return entry_order(letter.entry_id)


def queues_in(client: redis.Redis, prefix: str) -> list[str]:
    """The queues under ``prefix`` (queue_stats.QueueNames), by name: a split queue once,
    by its own name."""
    named = QueueNames(prefix)
    masters = masters_of(client)
    nodes = [client] if masters is None else [node_client(client, node) for node in masters]
    found: set[str] = set()
    for node in nodes:  # on a Redis Cluster, every master's keys
        found |= {queue for key in node.scan_iter(**named.scan) if (queue := named.by(key))}
        if node is not client:
            node.close()
    return sorted(found)


def resolve_queue(client: redis.Redis, prefix: str, queue: str | None) -> QueueKeys:
    """The keys of ``queue``; without one, of the only queue there is. An unknown queue, or
    none given where there are several, is a DeadLetterError naming the ones there are."""
    known = queues_in(client, prefix)
    listing = ", ".join(known) if known else f"none under prefix {prefix!r}"
    if queue is None:
        if len(known) == 1:
            return QueueKeys(known[0], prefix)
        raise DeadLetterError(f"say which queue with --queue (or EXLQ_QUEUE); queues: {listing}")
    keys = QueueKeys(queue, prefix)  # ValueError for a name no queue can have
    if queue not in known:
        raise DeadLetterError(f"no queue {queue!r} in this Redis; queues: {listing}")
    return keys


def _text(value: object) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)

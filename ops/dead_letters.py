"""A queue's dead letters (the stream ``P:{Q}:dead``, written by the worker's commit script):
read them, put their jobs back in their lanes, delete them. Every Redis command of
``exlq dead`` is here; dead_cli.py only talks to the operator.

A replay keeps the job's id, so that ``exlq result``/``status`` and a client waiting on the
id see the rerun. The SDK's submit would refuse it (it dedupes on the job's state hash, which
also counts the attempts the worker's start script adds to), so the replay is one script of
its own: check, enqueue to the job's lane, reset the state hash (attempts 0: the next start
is attempt 1; no cancel flag), delete the old result, and only then delete the dead letter.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import cast

import redis

from exlq.ops.queue_stats import QueueNames
from exlq.protocol.keys import Lane, QueueKeys, entry_ref, split_entry_ref
from exlq.protocol.models import InvalidRequest, parse_request
from exlq.protocol.slot_routing import masters_of, node_client

_STREAM_ID = re.compile(r"^\d+(-\d+)?$")
# Dead letters read per round trip when one is looked for by job id, or counted.
_PAGE = 500


class DeadLetterError(Exception):
    """What an operator asked for cannot be done; the message says why."""


@dataclass(frozen=True)
class DeadLetter:
    """One entry of the dead stream, as the worker wrote it."""

    entry_id: str  # its id in the dead stream
    fields: dict[str, str]  # everything the worker wrote

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


@dataclass(frozen=True)
class NotReplayed:
    """A dead letter left as it was, and why."""

    dead_id: str
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


class DeadLetters:
    """The dead letters of one queue, on a synchronous Redis client."""

    def __init__(self, client: redis.Redis, keys: QueueKeys) -> None:
        self.client = client
        self.keys = keys
        self._replay = client.register_script(REPLAY_LUA)

    def count(self) -> int:
        return int(self.client.xlen(self.keys.dead))

    def newest(self, count: int) -> list[DeadLetter]:
        """Up to ``count`` dead letters, newest first."""
        return self._letters(self.client.xrevrange(self.keys.dead, "+", "-", count=count))

    def find(self, ident: str) -> DeadLetter:
        """The dead letter whose id is ``ident``, else the newest whose job's id is."""
        if _STREAM_ID.fullmatch(ident):
            found = self._letters(self.client.xrange(self.keys.dead, ident, ident))
            if found:
                return found[0]
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
        """Queue ``letter``'s job again in its lane, under its id, as attempt 1."""
        try:
            request = parse_request(letter.request_json)
        except InvalidRequest as exc:
            return NotReplayed(letter.entry_id, letter.job_id, f"its request does not parse: {exc}")
        if request.past_deadline(time.time()):
            reason = "its deadline has passed: it would end expired without running"
            return NotReplayed(letter.entry_id, request.id, reason)
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
            return Replayed(request.id, new_entry, lane, self.keys.events(request.id))
        reason = _REFUSALS[verdict].format(job=self.keys.job(request.id), detail=detail)
        return NotReplayed(letter.entry_id, request.id, reason)

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

    def _newest_first(self) -> Iterator[DeadLetter]:
        end = "+"
        while True:
            page = self._letters(self.client.xrevrange(self.keys.dead, end, "-", count=_PAGE))
            yield from page
            if len(page) < _PAGE:
                return
            end = f"({page[-1].entry_id}"

    @staticmethod
    def _letters(raw: object) -> list[DeadLetter]:
        entries = cast("list[tuple[object, dict[object, object]]]", raw)
        return [
            DeadLetter(_text(entry_id), {_text(k): _text(v) for k, v in fields.items()})
            for entry_id, fields in entries
        ]


def queues_in(client: redis.Redis, prefix: str) -> list[str]:
    """The queues under ``prefix`` (queue_stats.QueueNames), by name."""
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

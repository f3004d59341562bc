"""Batches in Redis: the batch object (a hash, one JSON value per field), its working keys
(input lines, jobs in flight, finished lines, the runner's lease), all under the hash tag
``{batch_id}``, and two indexes: every batch by creation time, and the batches still open.

Every change of status is a compare-and-set on the status, so a replica whose lease lapsed
mid-step cannot undo what the replica that took over did."""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from exlq.producer.gateways.openai_api.list_page import ListPage

BatchStatus = Literal[
    "validating",
    "failed",
    "in_progress",
    "finalizing",
    "completed",
    "expired",
    "cancelling",
    "cancelled",
]
# How a batch that stopped taking work ends: written when it stops, read by the finalizer.
Ending = Literal["completed", "cancelled", "expired"]
BATCH_ID_PATTERN = re.compile(r"^batch_[A-Za-z0-9]{1,64}$")
# Fields of the hash the API does not show: the runner's progress.
SUBMITTED = "_submitted"  # lines submitted (or refused) so far, in file order
ENDING = "_ending"
_OBJECT_FIELDS = (
    "id",
    "object",
    "endpoint",
    "errors",
    "input_file_id",
    "completion_window",
    "status",
    "output_file_id",
    "error_file_id",
    "created_at",
    "in_progress_at",
    "expires_at",
    "finalizing_at",
    "completed_at",
    "failed_at",
    "expired_at",
    "cancelling_at",
    "cancelled_at",
    "request_counts",
    "metadata",
)

# KEYS[1] the batch; ARGV[1] the status expected (JSON), ARGV[2] '1' to also require that
# no ending was written; then field, value pairs to write.
_SET_IF_STATUS_LUA = """
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
if ARGV[2] == '1' and redis.call('HEXISTS', KEYS[1], '_ending') == 1 then return 0 end
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
"""
# KEYS[1] the batch; ARGV[1] the time. A batch still taking work starts cancelling; the
# status it had is returned either way ('' for none).
_CANCEL_LUA = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return '' end
if (status == '"validating"' or status == '"in_progress"')
    and redis.call('HEXISTS', KEYS[1], '_ending') == 0 then
  redis.call('HSET', KEYS[1], 'status', '"cancelling"', 'cancelling_at', ARGV[1])
end
return status
"""


def new_batch_id() -> str:
    return f"batch_{secrets.token_hex(16)}"


@dataclass(frozen=True)
class BatchKeys:
    prefix: str

    @property
    def index(self) -> str:
        """Sorted set of every batch id, scored by creation time."""
        return f"{self.prefix}:batches"

    @property
    def open(self) -> str:
        """Set of the batches a runner still has work on."""
        return f"{self.prefix}:batches:open"

    def _base(self, batch_id: str) -> str:
        return f"{self.prefix}:batch:{{{batch_id}}}"

    def batch(self, batch_id: str) -> str:
        return self._base(batch_id)

    def input(self, batch_id: str) -> str:
        """Hash: line number (from 0, blank lines not counted) -> the input file's request
        line, as validated. A hash, not a list: a line is read by its number in O(1)."""
        return f"{self._base(batch_id)}:input"

    def pending(self, batch_id: str) -> str:
        """Hash: line number -> the model and number of jobs of a line submitted and not
        yet finished."""
        return f"{self._base(batch_id)}:pending"

    def output(self, batch_id: str) -> str:
        """Hash: line number -> the output file's line of a request that succeeded."""
        return f"{self._base(batch_id)}:output"

    def errors(self, batch_id: str) -> str:
        """Hash: line number -> the error file's line of a request that failed."""
        return f"{self._base(batch_id)}:errors"

    def stopped(self, batch_id: str) -> str:
        """Hash: line number -> the error file's line of a request the batch's cancel or
        expiry stopped (batch_cancelled, batch_expired)."""
        return f"{self._base(batch_id)}:stopped"

    def lease(self, batch_id: str) -> str:
        return f"{self._base(batch_id)}:lease"

    def working(self, batch_id: str) -> list[str]:
        """What a finished batch no longer needs."""
        return [
            self.input(batch_id),
            self.pending(batch_id),
            self.output(batch_id),
            self.errors(batch_id),
            self.stopped(batch_id),
        ]


def encode(fields: Mapping[str, Any]) -> dict[FieldT, EncodableT]:
    return {name: json.dumps(value, separators=(",", ":")) for name, value in fields.items()}


def decode(raw: Mapping[bytes, bytes]) -> dict[str, Any]:
    return {name.decode(): json.loads(value) for name, value in raw.items()}


def batch_object(fields: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's batch object from the decoded hash."""
    return {name: fields.get(name) for name in _OBJECT_FIELDS}


class BatchStore:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.keys = BatchKeys(prefix)
        self._set_if_status = redis.register_script(_SET_IF_STATUS_LUA)
        self._cancel = redis.register_script(_CANCEL_LUA)

    async def create(self, fields: dict[str, Any], created_at: float) -> None:
        """Writes a new batch, then lists it (one slot per command, so valid on Redis
        Cluster: a batch written but not yet listed is seen by nobody)."""
        batch_id = fields["id"]
        await self.redis.hset(self.keys.batch(batch_id), mapping=encode(fields))
        await self.redis.zadd(self.keys.index, {batch_id: created_at})
        await self.redis.sadd(self.keys.open, batch_id)

    async def fields(self, batch_id: str) -> dict[str, Any] | None:
        """Every field of the batch, the runner's included; None for no such batch."""
        if not BATCH_ID_PATTERN.fullmatch(batch_id):
            return None
        raw = cast("dict[bytes, bytes]", await self.redis.hgetall(self.keys.batch(batch_id)))
        return decode(raw) if raw else None

    async def get(self, batch_id: str) -> dict[str, Any] | None:
        found = await self.fields(batch_id)
        return None if found is None else batch_object(found)

    async def set_if_status(
        self,
        batch_id: str,
        status: BatchStatus,
        fields: Mapping[str, Any],
        *,
        unless_ending: bool = True,
    ) -> bool:
        """Writes ``fields`` only if the batch's status is ``status`` (and, with
        ``unless_ending``, no ending was written); True if written."""
        args: list[str] = [json.dumps(status), "1" if unless_ending else "0"]
        for name, value in fields.items():
            args += [name, json.dumps(value, separators=(",", ":"))]
        done = await self._set_if_status(keys=[self.keys.batch(batch_id)], args=args)
        return bool(done)

    async def request_cancel(self, batch_id: str, now: int) -> str:
        """Starts cancelling a batch still taking work; returns the status it had."""
        found = await self._cancel(keys=[self.keys.batch(batch_id)], args=[str(now)])
        text = found.decode() if isinstance(found, bytes) else str(found)
        return cast("str", json.loads(text)) if text else ""

    async def open_ids(self) -> list[str]:
        members = cast("set[bytes]", await self.redis.smembers(self.keys.open))
        return sorted(m.decode() for m in members)

    async def close(self, batch_id: str) -> None:
        """The batch has ended: no runner needs to look at it or keep its working keys."""
        await self.redis.srem(self.keys.open, batch_id)
        await self.redis.delete(*self.keys.working(batch_id))

    async def page(self, after: str | None, limit: int) -> ListPage:
        """Batches newest first, after ``after``."""
        start = 0
        if after is not None:
            rank = await self.redis.zrevrank(self.keys.index, after)
            if rank is None:
                return ListPage([], False)
            start = int(cast("int", rank)) + 1
        ids = cast("list[bytes]", await self.redis.zrevrange(self.keys.index, start, start + limit))
        pipe = self.redis.pipeline(transaction=False)
        for batch_id in ids[:limit]:
            pipe.hgetall(self.keys.batch(batch_id.decode()))
        found = cast("list[dict[bytes, bytes]]", await pipe.execute())
        return ListPage([batch_object(decode(raw)) for raw in found if raw], len(ids) > limit)

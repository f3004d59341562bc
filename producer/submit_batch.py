"""SubmitBatcher: the submits made in one pass of the event loop go to Redis together.

A service that takes many requests at once calls ``submit()`` from many tasks at once.
Sent one by one, each job costs a SUBSCRIBE and a script call, and a burst of 64 reaches
the queue over tens of milliseconds, so a worker starts the first job alone. Batched, the
burst costs one SUBSCRIBE for all its channels, then one pipeline of submit scripts, and
lands in the stream together. A lone submit goes out on the next pass of the loop, as it
did before: nothing waits for a batch to fill. A Redis that lost the script (a restart,
SCRIPT FLUSH) gets it again (producer.scripts).
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import cast

import redis.asyncio as aioredis

from producer.scripts import run_many
from producer.subscriber import EventRouter

# More than this many submits in one pass go out as several pipelines.
MAX_BATCH = 256

# Atomic: dedupe on the job id, refuse when the backlog is full, enqueue, record state.
SUBMIT_LUA = """
if redis.call('EXISTS', KEYS[1]) == 1 then
  return {'duplicate', redis.call('HGET', KEYS[1], 'state') or ''}
end
local max_backlog = tonumber(ARGV[3])
if max_backlog > 0 then
  local backlog = redis.call('XLEN', KEYS[2])
  if backlog >= max_backlog then return {'full', tostring(backlog)} end
end
local entry = redis.call('XADD', KEYS[2], '*', 'job', ARGV[1])
redis.call('HSET', KEYS[1], 'state', 'queued', 'entry', entry, 'attempts', 0)
redis.call('EXPIRE', KEYS[1], ARGV[2])
return {'queued', entry}
"""


@dataclass(frozen=True, slots=True)
class Submitted:
    """What the submit script said of one job, and the queue its events arrive in."""

    outcome: str  # 'queued', 'duplicate' or 'full'
    detail: str  # the entry id, the existing job's state, or the backlog
    events: asyncio.Queue[bytes]


@dataclass(slots=True)
class _Pending:
    channel: str
    keys: list[str]
    args: list[str | int]
    done: asyncio.Future[Submitted] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class SubmitBatcher:
    """Subscribes, then enqueues, every submit of one loop pass in two round trips."""

    def __init__(self, client: aioredis.Redis, router: EventRouter) -> None:
        self._redis = client
        self._router = router
        self._script = client.register_script(SUBMIT_LUA)
        self._waiting: list[_Pending] = []
        self._flushes: set[asyncio.Task[None]] = set()

    async def submit(self, channel: str, keys: list[str], args: list[str | int]) -> Submitted:
        """Subscribe to ``channel``, then run the submit script on ``keys`` and ``args``.

        If the caller is cancelled while its batch is out, the job may still be enqueued
        (as with any command already sent); its channel is then unsubscribed."""
        pending = _Pending(channel, keys, args)
        if not self._waiting:
            # Runs after every task that is ready now has run up to its own await.
            task = asyncio.create_task(self._flush(), name="exlq-submit-batch")
            self._flushes.add(task)
            task.add_done_callback(self._flushes.discard)
        self._waiting.append(pending)
        return await pending.done

    async def close(self) -> None:
        """Let batches already taken finish, so no caller is left waiting."""
        if self._flushes:
            await asyncio.gather(*self._flushes, return_exceptions=True)

    async def _flush(self) -> None:
        batch, self._waiting = self._waiting, []
        for start in range(0, len(batch), MAX_BATCH):
            await self._send(batch[start : start + MAX_BATCH])

    async def _send(self, batch: list[_Pending]) -> None:
        subscriptions: list[tuple[str, asyncio.Queue[bytes]]] = []
        try:
            queues = await self._router.subscribe_many([p.channel for p in batch])
            subscriptions = [(p.channel, q) for p, q in zip(batch, queues, strict=True)]
            replies = await run_many(self._redis, self._script, [(p.keys, p.args) for p in batch])
        except BaseException as exc:
            await self._router.unsubscribe_many(subscriptions)
            _fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        unwanted: list[tuple[str, asyncio.Queue[bytes]]] = []
        for pending, subscription, reply in zip(batch, subscriptions, replies, strict=True):
            if pending.done.done():  # the caller was cancelled meanwhile
                unwanted.append(subscription)
            elif isinstance(reply, Exception):
                unwanted.append(subscription)
                pending.done.set_exception(reply)
            else:
                outcome, detail = (_text(part) for part in cast("list[object]", reply))
                if outcome == "full":
                    unwanted.append(subscription)
                pending.done.set_result(Submitted(outcome, detail, subscription[1]))
        if unwanted:
            await self._router.unsubscribe_many(unwanted)


def _text(part: object) -> str:
    return part.decode() if isinstance(part, bytes) else str(part)


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for pending in batch:
        if not pending.done.done():
            if isinstance(exc, asyncio.CancelledError):
                pending.done.cancel()
            else:
                pending.done.set_exception(exc)

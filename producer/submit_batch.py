"""SubmitBatcher: the submits made in one pass of the event loop go to Redis together.

A service that takes many requests at once calls ``submit()`` from many tasks at once.
Sent one by one, each job costs a SUBSCRIBE and a script call, and a burst of 64 reaches
the queue over tens of milliseconds, so a worker starts the first job alone. Batched, the
burst goes out in pieces of up to PIECE jobs: one SUBSCRIBE for a piece's channels, then
one script that enqueues every job of the piece, so a worker's read takes a piece whole and
its engine prefills it in one pass. The next piece subscribes while this one's script runs,
and the scripts run in submit order. Pieces rather than the whole burst: the first jobs
reach a worker, and its GPU, while the SDK still works through the rest (each job costs
the SDK tens of microseconds of Python). Each job still gets its own outcome; one that
fails inside the script (say a key of the wrong type at its id) fails alone. A lone submit
goes out on the next pass of the loop, as it did before: nothing waits for a batch to
fill. A Redis that lost the script (a restart, SCRIPT FLUSH) gets it again.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from producer.batch_script import per_job_script, reply_pairs
from producer.keys import QueueKeys
from producer.subscriber import EventRouter

# Jobs per piece of a burst. 16 prompts of 256 tokens are one batched prefill pass of the
# worker's engine (4096 tokens). Redis runs nothing else while a script runs; a 256-job
# script took 3.5 ms of it (INFO commandstats, development machine), 16 jobs well under 1.
PIECE = 16

# Atomic per job: dedupe on the job id, refuse when the backlog is full, enqueue, record
# state. KEYS[1] is the stream, KEYS[1 + i] job i's state hash; ARGV[1] the state TTL,
# ARGV[2] the backlog limit (0: none), ARGV[2 + i] job i's request JSON.
SUBMIT_MANY_LUA = per_job_script(
    """
local stream = KEYS[1]
local ttl = ARGV[1]
local max_backlog = tonumber(ARGV[2])
local function submit(job, request)
  if redis.call('EXISTS', job) == 1 then
    return {'duplicate', redis.call('HGET', job, 'state') or ''}
  end
  if max_backlog > 0 then
    local backlog = redis.call('XLEN', stream)
    if backlog >= max_backlog then return {'full', tostring(backlog)} end
  end
  local entry = redis.call('XADD', stream, '*', 'job', request)
  redis.call('HSET', job, 'state', 'queued', 'entry', entry, 'attempts', 0)
  redis.call('EXPIRE', job, ttl)
  return {'queued', entry}
end""",
    "submit",
    first_key=2,
    arg_offset=1,
)


@dataclass(frozen=True, slots=True)
class Submitted:
    """What the submit script said of one job, and the queue its events arrive in."""

    outcome: str  # 'queued', 'duplicate' or 'full'
    detail: str  # the entry id, the existing job's state, or the backlog
    events: asyncio.Queue[bytes]


@dataclass(slots=True)
class _Pending:
    job_id: str
    request_json: str
    done: asyncio.Future[Submitted] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )


class SubmitBatcher:
    """Subscribes, then enqueues, the submits of one loop pass, a piece at a time."""

    def __init__(
        self,
        client: aioredis.Redis,
        router: EventRouter,
        keys: QueueKeys,
        state_ttl_s: int,
        max_backlog: int,
    ) -> None:
        self._redis = client
        self._router = router
        self._keys = keys
        self._state_ttl_s = state_ttl_s
        self._max_backlog = max_backlog
        self._script = client.register_script(SUBMIT_MANY_LUA)
        self._waiting: list[_Pending] = []
        self._flushes: set[asyncio.Task[None]] = set()

    async def submit(self, job_id: str, request_json: str) -> Submitted:
        """Subscribe to the job's channel, then enqueue ``request_json`` under ``job_id``.

        If the caller is cancelled while its batch is out, the job may still be enqueued
        (as with any command already sent); its channel is then unsubscribed."""
        pending = _Pending(job_id, request_json)
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
        pieces = [batch[start : start + PIECE] for start in range(0, len(batch), PIECE)]
        subscribing = self._subscribe(pieces[0])
        for index, piece in enumerate(pieces):
            # The next piece's SUBSCRIBE goes out while this piece's script runs.
            upcoming = self._subscribe(pieces[index + 1]) if index + 1 < len(pieces) else None
            try:
                await self._send(piece, subscribing)
            except BaseException as exc:  # cancelled: leave no caller waiting, no channel held
                if upcoming is not None:
                    await self._abandon(pieces[index + 1], upcoming)
                for rest in pieces[index:]:
                    _fail(rest, exc)
                raise
            if upcoming is not None:
                subscribing = upcoming

    async def _abandon(
        self, piece: list[_Pending], subscribing: asyncio.Task[list[asyncio.Queue[bytes]]]
    ) -> None:
        subscribing.cancel()
        try:
            queues = await subscribing
        except BaseException:
            return  # subscribe_many let go of its channels itself
        await self._router.unsubscribe_many(list(zip(self._channels(piece), queues, strict=True)))

    def _channels(self, piece: list[_Pending]) -> list[str]:
        return [self._keys.events(p.job_id) for p in piece]

    def _subscribe(self, piece: list[_Pending]) -> asyncio.Task[list[asyncio.Queue[bytes]]]:
        return asyncio.create_task(self._router.subscribe_many(self._channels(piece)))

    async def _send(
        self, piece: list[_Pending], subscribing: asyncio.Task[list[asyncio.Queue[bytes]]]
    ) -> None:
        subscriptions: list[tuple[str, asyncio.Queue[bytes]]] = []
        try:
            # subscribe_many unsubscribes on its own failure.
            queues = await subscribing
            subscriptions = list(zip(self._channels(piece), queues, strict=True))
            keys = [self._keys.jobs, *(self._keys.job(p.job_id) for p in piece)]
            args: list[str | int] = [self._state_ttl_s, self._max_backlog]
            args += [p.request_json for p in piece]
            # redis-py sends EVALSHA, and loads the script again where Redis lost it.
            reply = await self._script(keys=keys, args=args)
        except BaseException as exc:
            await self._router.unsubscribe_many(subscriptions)
            _fail(piece, exc)
            if not isinstance(exc, Exception):
                raise
            return
        unwanted: list[tuple[str, asyncio.Queue[bytes]]] = []
        for pending, subscription, (outcome, detail) in zip(
            piece, subscriptions, reply_pairs(reply), strict=True
        ):
            if pending.done.done():  # the caller was cancelled meanwhile
                unwanted.append(subscription)
            elif outcome == "error":
                unwanted.append(subscription)
                pending.done.set_exception(ResponseError(detail))
            else:
                if outcome == "full":
                    unwanted.append(subscription)
                pending.done.set_result(Submitted(outcome, detail, subscription[1]))
        if unwanted:
            await self._router.unsubscribe_many(unwanted)


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for pending in batch:
        if not pending.done.done():
            if isinstance(exc, asyncio.CancelledError):
                pending.done.cancel()
            else:
                pending.done.set_exception(exc)

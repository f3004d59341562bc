"""SubmitBatcher: the submits made in one pass of the event loop go to Redis together.

One batcher serves one priority lane (one stream); the producer holds one per lane.

A service that takes many requests at once calls ``submit()`` from many tasks at once.
Sent one by one, each job costs a SUBSCRIBE and a script call, and a burst reaches the
queue spread over as many round trips, so a worker starts the first job alone. Batched, each
piece of a burst is one write on the producer's event connection: one SUBSCRIBE for its
channels, then one script that enqueues every job of the piece. Redis runs the script after
the SUBSCRIBE, so no event is missed, and the piece's submit is one round trip. Its entries
land in the stream together, so a worker's read takes them in one piece and its engine
starts them in one pass. Each job still gets its own outcome; one that fails inside the
script (say a key of the wrong type at its id) fails alone. A lone submit goes out on the
next pass of the loop, as it did before: nothing waits for a batch to fill. A Redis that
lost the script (a restart, SCRIPT FLUSH) gets it again.

A large burst goes out in pieces of PIECE_JOBS. On Python >= 3.12 a piece is written as
soon as it is full and one more submit of the pass waits behind it (an eagerly started
task), while the loop pass goes on validating the rest of the burst: a worker starts on the
first piece while the others are still being built here. The pass's first PIECE_JOBS jobs,
the engine's first slice, go in pieces of FIRST_PIECE_JOBS, so a worker hears of a burst
after a few jobs are validated, and its engine readies each few while the next are
validated, not the last 24 at once. Earlier Pythons send the pieces at the end of the
pass, in order.

Every entry of a piece that has another piece of the same pass behind it carries the field
``more`` (``1``): a worker that reads it waits a moment for the rest of the burst
(``burst_wait_ms``) and starts it in one engine pass, as one piece written at once would
be. A piece is sent early only while a submit waits behind it, so the piece that ends a
pass is always written, and it carries no mark.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any, cast

import redis.asyncio as aioredis
from redis.exceptions import NoScriptError, ResponseError

from exlq.producer.errors import NotReplicated
from exlq.producer.subscriber import EventRouter
from exlq.protocol.batch_script import PIECE_JOBS, per_job_script, reply_pairs
from exlq.protocol.eager_task import EAGER_START, eager_task
from exlq.protocol.keys import Lane, QueueKeys, entry_ref

# The pieces of a loop pass's first PIECE_JOBS jobs: a worker offers each to its engine
# while the SDK validates the next (docs/PERFORMANCE.md, "Starting a burst (always on)").
FIRST_PIECE_JOBS = 8

# Atomic per job: dedupe on the job id, refuse when the backlog is full, enqueue, record
# state. KEYS[1] is the lane's stream, KEYS[1 + i] job i's state hash; ARGV[1] the state
# TTL, ARGV[2] the backlog limit (0: none), ARGV[3] '1' when more of the burst follows this
# piece (each entry then carries more=1), else '', ARGV[4] what the job hash appends to the
# entry id to name the lane (keys.entry_ref), ARGV[4 + i] job i's request JSON.
SUBMIT_MANY_LUA = per_job_script(
    """
local stream = KEYS[1]
local ttl = ARGV[1]
local max_backlog = tonumber(ARGV[2])
local marks = ARGV[3] == '1' and {'more', '1'} or {}
local function submit(job, request)
  if redis.call('EXISTS', job) == 1 then
    return {'duplicate', redis.call('HGET', job, 'state') or ''}
  end
  if max_backlog > 0 then
    local backlog = redis.call('XLEN', stream)
    if backlog >= max_backlog then return {'full', tostring(backlog)} end
  end
  local entry = redis.call('XADD', stream, '*', 'job', request, unpack(marks)) .. ARGV[4]
  redis.call('HSET', job, 'state', 'queued', 'entry', entry, 'attempts', 0)
  redis.call('EXPIRE', job, ttl)
  return {'queued', entry}
end""",
    "submit",
    first_key=2,
    arg_offset=3,
)


# Whether a full piece goes out at once (an eager task) or with the end of the loop pass;
# where Python can start tasks eagerly, bench.sdk_path turns it off to compare the two.
EAGER_SEND = EAGER_START


@dataclass(frozen=True, slots=True)
class Replicas:
    """How many replicas must hold a submit before it returns (Redis WAIT, sent behind the
    submit's script on the same connection), and how long to wait for them."""

    count: int
    wait_ms: int

    @property
    def command(self) -> tuple[str, int, int]:
        return ("WAIT", self.count, self.wait_ms)

    def met(self, confirmed: object) -> bool:
        return isinstance(confirmed, int) and confirmed >= self.count

    def short(self, job_id: str, confirmed: object) -> NotReplicated:
        got = confirmed if isinstance(confirmed, int) else 0
        return NotReplicated(job_id, got, self.count, self.wait_ms)


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
    """Subscribes, then enqueues, every submit of one loop pass in one round trip."""

    def __init__(
        self,
        client: aioredis.Redis,
        router: EventRouter,
        keys: QueueKeys,
        state_ttl_s: int,
        max_backlog: int,
        lane: Lane = "interactive",
        replicas: Replicas | None = None,
    ) -> None:
        self._redis = client
        self._router = router
        self._keys = keys
        self._stream = keys.lane_jobs(lane)
        self._lane_mark = entry_ref("", lane)
        self._state_ttl_s = state_ttl_s
        self._max_backlog = max_backlog
        self._replicas = replicas
        self._script = client.register_script(SUBMIT_MANY_LUA)
        self._waiting: list[_Pending] = []
        self._flush_due = False
        self._sent_this_pass = 0  # jobs of this loop pass sent early, in full pieces
        self._flushes: set[asyncio.Task[None]] = set()

    async def submit(self, job_id: str, request_json: str) -> Submitted:
        """Subscribe to the job's channel, then enqueue ``request_json`` under ``job_id``.

        If the caller is cancelled while its batch is out, the job may still be enqueued
        (as with any command already sent); its channel is then unsubscribed."""
        pending = _Pending(job_id, request_json)
        self._waiting.append(pending)
        piece = FIRST_PIECE_JOBS if self._sent_this_pass < PIECE_JOBS else PIECE_JOBS
        if EAGER_SEND and len(self._waiting) > piece:
            # A full piece, and a submit behind it: the piece goes now, marked as followed.
            batch, self._waiting = self._waiting[:piece], self._waiting[piece:]
            self._sent_this_pass += piece
            self._spawn(self._send(batch, more=True), eager=True)
        if not self._flush_due:
            # Runs after every task that is ready now has run up to its own await.
            self._flush_due = True
            self._spawn(self._flush(), eager=False)
        return await pending.done

    async def close(self) -> None:
        """Let batches already taken finish, so no caller is left waiting."""
        if self._flushes:
            await asyncio.gather(*self._flushes, return_exceptions=True)

    def _spawn(self, send: Coroutine[None, None, None], eager: bool) -> None:
        if eager:
            # Runs now, up to its first real wait: the piece is written before submit()
            # returns to the rest of the burst.
            task = eager_task(send, name="exlq-submit-piece")
        else:
            task = asyncio.create_task(send, name="exlq-submit-batch")
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def _flush(self) -> None:
        self._flush_due = False
        self._sent_this_pass = 0
        batch, self._waiting = self._waiting, []
        # Written in order (the event connection's write lock is first come, first served),
        # each piece's reply awaited on its own; every piece but the last is followed.
        starts = range(0, len(batch), PIECE_JOBS)
        await asyncio.gather(
            *(
                self._send(batch[i : i + PIECE_JOBS], more=i + PIECE_JOBS < len(batch))
                for i in starts
            )
        )

    async def _send(self, batch: list[_Pending], more: bool = False) -> None:
        try:
            version = self._router.version  # found when the router connected
            channels = [self._keys.channel(p.job_id, version) for p in batch]
            keys = [self._stream, *(self._keys.job(p.job_id) for p in batch)]
            args: list[str | int] = [self._state_ttl_s, self._max_backlog, "1" if more else ""]
            args.append(self._lane_mark)
            args += [p.request_json for p in batch]
            script = ("EVALSHA", self._script.sha, len(keys), *keys, *args)
            wait = None if self._replicas is None else self._replicas.command
            try:
                queues, reply = await self._router.subscribe_then(channels, script, wait)
            except NoScriptError:
                # Redis lost the script (a restart, SCRIPT FLUSH): nothing was enqueued.
                await self._redis.script_load(SUBMIT_MANY_LUA)
                queues, reply = await self._router.subscribe_then(channels, script, wait)
            subscriptions = list(zip(channels, queues, strict=True))
            confirmed = None
            if wait is not None:
                reply, confirmed = cast("list[Any]", reply)
        except BaseException as exc:
            _fail(batch, exc)
            if not isinstance(exc, Exception):
                raise
            return
        unwanted = [
            subscription
            for pending, subscription, (outcome, detail) in zip(
                batch, subscriptions, reply_pairs(reply), strict=True
            )
            if not self._settle(pending, subscription, outcome, detail, confirmed)
        ]
        if unwanted:
            await self._router.unsubscribe_many(unwanted)

    def _settle(
        self,
        pending: _Pending,
        subscription: tuple[str, asyncio.Queue[bytes]],
        outcome: str,
        detail: str,
        confirmed: object,
    ) -> bool:
        """Answer one submit by the script's outcome (and the replicas that confirmed the
        piece); False where its channel is not wanted."""
        if pending.done.done():  # the caller was cancelled meanwhile
            return False
        if outcome == "error":
            pending.done.set_exception(ResponseError(detail))
            return False
        if outcome != "full" and self._replicas and not self._replicas.met(confirmed):
            pending.done.set_exception(self._replicas.short(pending.job_id, confirmed))
            return False
        pending.done.set_result(Submitted(outcome, detail, subscription[1]))
        return outcome != "full"


def _fail(batch: list[_Pending], exc: BaseException) -> None:
    for pending in batch:
        if not pending.done.done():
            if isinstance(exc, asyncio.CancelledError):
                pending.done.cancel()
            else:
                pending.done.set_exception(exc)

"""AsyncProducer: submit jobs, stream their events, fetch results, cancel."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import redis.asyncio as aioredis
from pydantic import ValidationError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_delay

from exlq.producer.errors import (
    ExlqError,
    JobFailed,
    JobLost,
    JobRestarted,
    NoWorkers,
    QueueFull,
)
from exlq.producer.partition import JobStatus, QueuePartition, router_for
from exlq.producer.quiet_wait import QuietWait
from exlq.producer.submit_batch import Replicas, Submitted
from exlq.producer.subscriber import RECONNECTED
from exlq.producer.worker_watch import DEFAULT_STALE_AFTER_S, WorkerWatch
from exlq.protocol.backoff import REDIS_BACKOFF
from exlq.protocol.command_packing import pack_in_c
from exlq.protocol.keys import DEFAULT_PREFIX, LANES, Lane, QueueKeys, partition_of
from exlq.protocol.models import (
    DoneEvent,
    ErrorEvent,
    Event,
    GenerationRequest,
    InvalidRequest,
    JobResult,
    RequeuedEvent,
    TokenEvent,
    describe_validation_error,
    final_state,
    parse_event,
)
from exlq.protocol.packed_ids import PackedIds
from exlq.protocol.partition_count import read_count
from exlq.protocol.redis_credentials import RedisCredentials
from exlq.protocol.slot_routing import client_like, follow_slot

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_STATE_TTL_S = 24 * 3600
# While a stream is quiet this long, look at the stored result in case the end of the job
# was published while its events could not arrive, and at whether Redis still holds the
# job at all (a FLUSHALL keeps the connection, so no reconnect tells of it). After a
# reconnect the router tells every handle at once; this is the fallback for losses nobody
# noticed.
RESULT_POLL_S = 30.0
# A job that has heard nothing this long after its submit looks at the workers' heartbeats:
# where none is live, nothing would ever run it (producer/worker_watch.py).
WORKER_CHECK_S = 3.0
# How long a submit is sent again while Redis is away: a cluster's failover takes its node
# timeout (15 s by default) and an election.
SUBMIT_RETRY_S = 30.0

# How long a submit with replicas=N waits for them to confirm it.
DEFAULT_REPLICA_WAIT_MS = 1000
# How long a producer trusts the queue's partition count before it reads it again: a
# count a worker raised reaches the producers within this (docs/SCALING.md).
PARTITION_COUNT_TTL_S = 30.0


def build_request(prompt: str | None, fields: dict[str, Any]) -> GenerationRequest:
    """Validate keyword fields into a request; raise InvalidRequest naming the fields at fault."""
    data = dict(fields)
    if prompt is not None:
        data["prompt"] = prompt
    try:
        return GenerationRequest.model_validate(data)
    except ValidationError as exc:
        raise InvalidRequest(describe_validation_error(exc)) from None


class JobHandle:
    """One submitted job. Consume it with stream(), stream_text() or result()."""

    def __init__(
        self,
        producer: AsyncProducer,
        job_id: str,
        events: asyncio.Queue[bytes],
        duplicate: bool,
        partition: QueuePartition,
    ) -> None:
        self.id = job_id
        self.duplicate = duplicate
        self._producer = producer
        self._partition = partition  # where the job is, whatever the count becomes
        self._events = events
        self._wait = QuietWait(events)
        self._final: DoneEvent | ErrorEvent | None = None
        self._text: list[str] = []
        self._last_seq = -1
        self._attempt = 1
        self._gap = False  # some events never arrived: the rest comes from the stored result
        self._pending_end: Event | None = None
        self._quiet_waits = 0

    @property
    def finished(self) -> bool:
        return self._final is not None

    @property
    def _started(self) -> bool:
        return self._last_seq >= 0 or self._attempt > 1

    async def _check_served(self) -> bool:
        """The job has not started: where no live worker serves its queue, cancel it and
        raise NoWorkers; with wait_for_worker, warn and wait on. True where the cancel
        found no state for the job: the stored result then tells an end from a loss."""
        watch = self._producer._workers
        try:
            if await watch.served():
                return False
            if watch.wait_for_worker:
                watch.warn_waiting(self.id)
                return False
            state = await self._partition.cancel_if_queued(self.id)
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            # Redis is away: the handle waits it out, as its other reads do; asked again
            # at the next quiet spell.
            log.debug("job %s: the workers' heartbeats could not be read (%s)", self.id, exc)
            return False
        if state == "queued":
            raise NoWorkers(self.id, watch.keys.queue, watch.stale_after_s)
        # Else it has started (or ended) meanwhile, and its events are on their way; or its
        # state is gone (a flush or a restart also empties the heartbeats, so this is where
        # a job that waits for a worker hears of it first).
        return not state

    async def stream(self) -> AsyncIterator[Event]:
        """Yield the job's events as they arrive, ending after ``done`` or ``error``."""
        try:
            if self.duplicate and self._last_seq < 0:
                # The job may have ended before this handle subscribed.
                for event in await self._recover_from_result():
                    yield self._track(event)
            while self._final is None:
                for event in await self._next_events():
                    yield self._track(event)
        except JobLost:
            # Nothing will publish on the channel of a job Redis has forgotten: leave it.
            await self._partition.release(self.id, self._events)
            raise
        finally:
            self._wait.close()
        # A caller that stops reading early keeps the channel: result() or stream() goes on
        # from where it stopped, and lets it go at the end (or detach() does).
        await self._partition.release(self.id, self._events)

    async def detach(self) -> None:
        """Stop following the job: its channel is unsubscribed, and the job runs on. Its
        result stays readable (``AsyncProducer.get_result``). For a producer that submits
        many jobs and reads their results later, rather than holding a subscription each."""
        await self._partition.release(self.id, self._events)

    async def _next_events(self) -> list[Event]:
        first_wait = not self._started and not self._quiet_waits
        raw = await self._wait.next(WORKER_CHECK_S if first_wait else RESULT_POLL_S)
        if raw is None:  # quiet: does no worker serve the job; did it end unheard, or is it lost?
            self._quiet_waits += 1
            state_gone = not self._started and await self._check_served()
            if first_wait and not state_gone:
                # The first check reads only the heartbeats, one read shared by every
                # handle: a result read here would be one more round trip per queued job.
                return []
            return await self._recover_from_result()
        if raw == RECONNECTED:  # events may have been lost, or Redis restarted empty
            return await self._recover_from_result()
        accepted = self._accept(parse_event(raw))
        if accepted is not None:
            return [accepted]
        if self._gap and isinstance(self._pending_end, DoneEvent | ErrorEvent):
            # Events were lost: finish from the stored result, written with the end.
            return await self._recover_from_result(wait=True)
        return []

    def _accept(self, event: Event) -> Event | None:
        """The event to yield, or None: late events of an earlier attempt, duplicates, and
        everything after a gap in seq (the subscriber was cut off) are held back."""
        if event.attempt < self._attempt or (
            event.attempt == self._attempt and event.seq <= self._last_seq
        ):
            return None
        in_order = event.seq == self._last_seq + 1 or (
            isinstance(event, RequeuedEvent) and event.attempt > self._attempt
        )
        if self._gap or not in_order:
            self._gap = True
            if isinstance(event, DoneEvent | ErrorEvent):
                self._pending_end = event
            return None
        return event

    async def stream_text(self) -> AsyncIterator[str]:
        """Yield only the text. A retry that repeats the text already yielded is skipped;
        one that diverges raises JobRestarted. A failed job raises JobFailed."""
        yielded = ""
        attempt_text = ""
        async for event in self.stream():
            if isinstance(event, RequeuedEvent):
                attempt_text = ""
            elif isinstance(event, ErrorEvent):
                raise JobFailed(self.id, event.error)
            elif isinstance(event, TokenEvent):
                attempt_text += event.text
                if len(attempt_text) <= len(yielded):
                    if not yielded.startswith(attempt_text):
                        raise JobRestarted(f"job {self.id} was retried and its text changed")
                    continue
                if not attempt_text.startswith(yielded):
                    raise JobRestarted(f"job {self.id} was retried and its text changed")
                new = attempt_text[len(yielded) :]
                yielded = attempt_text
                yield new

    async def result(self, timeout: float | None = None) -> JobResult:
        """Wait for the job to end and return its result; raise JobFailed if it failed.

        A handle that saw the whole stream builds the result from it; the stored copy (the
        worker writes it in the same script as the final event) is read only when events
        were lost, so a result that has since expired does not matter."""
        async with asyncio.timeout(timeout):
            async for _ in self.stream():
                pass
            result = self._result_from_stream()
            if result is None:
                result = await self._stored_result()
            if result is None:
                raise ExlqError(f"job {self.id} ended but its result has expired")
        if result.state == "failed" and result.error is not None:
            raise JobFailed(self.id, result.error)
        return result

    def _result_from_stream(self) -> JobResult | None:
        final = self._final
        if self._gap or final is None:
            return None
        if isinstance(final, ErrorEvent):
            return JobResult(
                id=self.id,
                state="failed",
                text="".join(self._text),
                error=final.error,
                attempts=final.attempt,
            )
        return JobResult(
            id=self.id,
            state=final_state(final.finish_reason),
            text="".join(self._text),
            finish_reason=final.finish_reason,
            usage=final.usage,
            timings=final.timings,
            attempts=final.attempt,
        )

    async def cancel(self) -> str:
        return await self._partition.cancel(self.id)

    async def _stored_result(self) -> JobResult | None:
        """The stored result; None while the job has not ended. Raises JobLost where Redis
        holds neither the result nor the job's state: the worker writes the result and the
        state's end in one script, and the state lives from the submit on (its TTL renewed
        while a worker runs the job), so neither means Redis has forgotten the job and
        nothing would end the wait."""
        result, state_held = await self._result_and_state()
        if result is None and not state_held:
            raise JobLost(self.id)
        return result

    async def _result_and_state(self) -> tuple[JobResult | None, bool]:
        """The stored result and whether the state exists, riding out Redis outages: a
        handle waits for its job."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((RedisConnectionError, RedisTimeoutError, OSError)),
            wait=REDIS_BACKOFF,
            before_sleep=_log_retry,
        ):
            with attempt:
                return await self._partition.result_and_state(self.id)
        raise AssertionError("unreachable: the retry loop returns or raises")

    def _track(self, event: Event) -> Event:
        if isinstance(event, RequeuedEvent):
            self._text.clear()
            self._attempt = event.attempt
        elif isinstance(event, TokenEvent):
            self._text.append(event.text)
        elif isinstance(event, DoneEvent | ErrorEvent):
            self._final = event
        self._last_seq = event.seq
        return event

    async def _recover_from_result(self, wait: bool = False) -> list[Event]:
        """Rebuild the end of the stream from the stored result, if the job has ended."""
        stored = await self._stored_result()
        if stored is None and wait:
            # The final event was seen, and the result is written in the same script.
            raise ExlqError(f"job {self.id}: events were lost and its result has expired")
        if stored is None:
            return []
        received = "".join(self._text)
        seq = self._last_seq + 1
        events: list[Event] = []
        if stored.text != received:
            if not stored.text.startswith(received):
                events.append(
                    RequeuedEvent(id=self.id, seq=seq, attempt=stored.attempts, reason="recovered")
                )
                seq, received = 0, ""
            events.append(
                TokenEvent(
                    id=self.id,
                    seq=seq,
                    attempt=max(stored.attempts, 1),
                    text=stored.text[len(received) :],
                    token_ids=[],
                )
            )
            seq += 1
        attempt = max(stored.attempts, 1)
        if stored.error is not None:
            events.append(ErrorEvent(id=self.id, seq=seq, attempt=attempt, error=stored.error))
        elif stored.finish_reason is not None and stored.usage and stored.timings:
            events.append(
                DoneEvent(
                    id=self.id,
                    seq=seq,
                    attempt=attempt,
                    finish_reason=stored.finish_reason,
                    usage=stored.usage,
                    timings=stored.timings,
                )
            )
        return events


class AsyncProducer:
    """Submits jobs to one queue. Use as ``async with AsyncProducer(url, queue=...) as p``."""

    def __init__(
        self,
        redis_url: str = "redis://localhost:6379/0",
        *,
        queue: str,
        prefix: str = DEFAULT_PREFIX,
        max_backlog: int = 0,
        state_ttl_s: int = DEFAULT_STATE_TTL_S,
        max_connections: int = 32,
        client: aioredis.Redis | None = None,
        pack_ids: bool = False,
        wait_for_worker: bool = False,
        worker_stale_after_s: float = DEFAULT_STALE_AFTER_S,
        credentials: RedisCredentials | None = None,
        replicas: int = 0,
        replica_wait_ms: int = DEFAULT_REPLICA_WAIT_MS,
    ) -> None:
        """A job that has heard nothing WORKER_CHECK_S after its submit, and every
        RESULT_POLL_S after that until it starts, is checked against the workers'
        heartbeats: where no live worker serves the queue (none sent one within
        ``worker_stale_after_s``), the job is cancelled and its handle raises NoWorkers.
        ``wait_for_worker=True`` logs a warning instead and lets jobs wait for workers that
        start later (a worker still loading its model, a fleet scaled to zero). A submit
        itself never reads the heartbeats.

        A handle raises JobLost where Redis holds neither the job's state nor its result:
        at once after a reconnect to a Redis that restarted without persistence; after a
        FLUSHALL, which keeps the connection, at the next quiet poll (RESULT_POLL_S of
        silence). The state's TTL, ``state_ttl_s``, bounds how long a job may wait
        queued: one still queued after it is reported lost, though a worker may yet run
        its entry. A worker renews the TTL once it runs the job.

        ``pack_ids=True`` sends a submit's ``input_ids`` as ``input_ids_b64``, one base64
        string instead of a JSON number per id, so neither the SDK nor the worker makes a
        Python int of each id (docs/PERFORMANCE.md, "The way back, and Redis (always on)").
        Turn it on once every worker on the queue runs an exlq that reads the field: an
        older worker refuses such a job, with an error event that names the field.

        ``credentials`` log the connections in, over the URL's user and password (which a
        URL needs percent-encoded); ``RedisCredentials()`` reads EXLQ_REDIS_USERNAME and
        EXLQ_REDIS_PASSWORD. Unused with ``client``, which comes logged in.

        ``replicas=N`` makes a submit return only once N replicas of the queue's master
        hold the job (Redis WAIT, behind the submit on its connection, up to
        ``replica_wait_ms``), so that a failover cannot lose a job whose submit returned;
        else it raises NotReplicated, and the same id may be submitted again. It costs a
        replica's round trip per submit (docs/SCALING.md, "Failover")."""
        if replicas < 0 or replica_wait_ms < 1:
            raise ValueError("replicas must be 0 or more, and replica_wait_ms 1 or more")
        self.keys = QueueKeys(queue=queue, prefix=prefix)
        self._replicas = Replicas(replicas, replica_wait_ms) if replicas else None
        self.max_backlog = max_backlog
        self.pack_ids = pack_ids
        self.state_ttl_s = state_ttl_s
        self._owns_client = client is None
        if client is None:
            # A blocking pool: a burst of submits waits for a free connection instead of
            # failing with "Too many connections". The event router's connection is its
            # own, outside the pool.
            pool = aioredis.BlockingConnectionPool.from_url(
                redis_url, max_connections=max(max_connections, 1), timeout=None
            )
            if credentials is not None:  # e.g. RedisCredentials(): EXLQ_REDIS_PASSWORD
                credentials.apply_to(pool)
            follow_slot(pool, self.keys.jobs)  # the queue's node of a Redis Cluster
            pack_in_c(pool)
            client = aioredis.Redis(connection_pool=pool)
        self._redis = client
        self._router = router_for(client, self.keys)
        base = QueuePartition(
            client, self._router, self.keys, state_ttl_s, max_backlog, self._replicas
        )
        self._submits = base.submits
        # Partition 0 is the queue's own keys; the others are made when a job first goes
        # to them (a queue split in partitions, docs/SCALING.md).
        self._partitions: dict[int, QueuePartition] = {0: base}
        self._partition_count = 1
        self._count_read_at: float | None = None
        self._count_reading: asyncio.Future[int] | None = None
        self._workers = WorkerWatch(
            client,
            self.keys,
            stale_after_s=worker_stale_after_s,
            wait_for_worker=wait_for_worker,
        )

    async def __aenter__(self) -> AsyncProducer:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        await self._workers.close()
        for n, partition in self._partitions.items():
            await partition.close()
            if n and partition.router is not self._router:
                await partition.router.close()
            if n:
                await partition.client.aclose(close_connection_pool=True)
        await self._router.close()
        if self._owns_client:
            await self._redis.aclose(close_connection_pool=True)

    async def submit(
        self,
        prompt: str | None = None,
        *,
        request: GenerationRequest | None = None,
        priority: Lane = "interactive",
        **fields: Any,
    ) -> JobHandle:
        """Enqueue a job and return its handle. Subscribes before enqueuing, so no event is
        missed. Submitting an id that exists returns a handle to that same job. Submits made
        at once (from many tasks) go to Redis together: one SUBSCRIBE and one script, in one
        write.

        ``priority`` picks the lane: a worker fills free slots with ``interactive`` jobs
        first and gives ``batch`` jobs the rest, plus a share it always keeps for them, so
        a batch lane is never starved (docs/ARCHITECTURE.md, "Priority lanes"). The backlog
        limit counts each lane on its own."""
        if priority not in LANES:
            raise ValueError(f"priority {priority!r} is not a lane: use one of {', '.join(LANES)}")
        if request is not None and (prompt is not None or fields):
            raise TypeError("pass either request= or prompt and fields, not both")
        # Only the id and the JSON wait for Redis: a request built here (its prompt's
        # ids are a list of hundreds) is freed before the wait, not carried into the
        # young generation of the host process's collector (docs/PERFORMANCE.md, "The way
        # back, and Redis (always on)").
        if self.pack_ids and "input_ids" in fields:
            fields = _with_packed_ids(fields)
        # The first submit connects the event connection, which finds whether job events
        # go on shard channels (a Redis Cluster: wire version 2); the request says so.
        if self._router.sharded is None:
            await self._router.start()
        version = self._router.version
        if request is None:  # built and serialized in one expression: freed before the wait
            job_id, request_json = _wire_form(
                build_request(prompt, {**fields, "v": version} if version > 1 else fields)
            )
        else:
            same = request.v == version
            job_id, request_json = _wire_form(
                request if same else request.model_copy(update={"v": version})
            )
        partition, submitted = await self._submit_riding_out_outages(priority, job_id, request_json)
        if submitted.outcome == "full":
            raise QueueFull(
                f"queue {self.keys.queue!r} holds {submitted.detail} jobs, at its limit of "
                f"{self.max_backlog}: retry later or add workers"
            )
        duplicate = submitted.outcome == "duplicate"
        return JobHandle(self, job_id, submitted.events, duplicate, partition)

    async def _submit_riding_out_outages(
        self, lane: Lane, job_id: str, request_json: str
    ) -> tuple[QueuePartition, Submitted]:
        """The submit, to the job's partition, sent again with the same id while the
        connection is lost (a Redis restart, a cluster's failover), for up to
        SUBMIT_RETRY_S: the id makes it one job however many of the tries reached Redis."""
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type((RedisConnectionError, RedisTimeoutError, OSError)),
            wait=REDIS_BACKOFF,
            stop=stop_after_delay(SUBMIT_RETRY_S),
            before_sleep=_log_retry,
            reraise=True,
        ):
            with attempt:
                partition = await self._partition_of(job_id)
                if partition.router.sharded is None:
                    await partition.router.start()
                return partition, await partition.submits[lane].submit(job_id, request_json)
        raise AssertionError("unreachable: the retry loop returns or raises")

    async def _partition_of(self, job_id: str) -> QueuePartition:
        """The partition job ``job_id`` goes to, by the queue's count (read again after
        PARTITION_COUNT_TTL_S)."""
        return self._partition(partition_of(job_id, await self._count()))

    async def _count(self) -> int:
        read_at = self._count_read_at
        if read_at is None or time.monotonic() - read_at > PARTITION_COUNT_TTL_S:
            await self._read_partition_count()
        return self._partition_count

    async def get_results(self, job_ids: list[str]) -> list[JobResult | None]:
        """Many jobs' stored results, in ``job_ids``' order: one MGET per partition."""
        found: dict[str, JobResult | None] = {}
        for partition, ids in (await self._by_partition(job_ids)).items():
            raws = await partition.client.mget([partition.keys.result(i) for i in ids])
            for job_id, raw in zip(ids, raws, strict=True):
                found[job_id] = None if raw is None else JobResult.model_validate_json(raw)
        return [found[job_id] for job_id in job_ids]

    async def states_held(self, job_ids: list[str]) -> list[bool]:
        """Whether Redis holds each job's state, in ``job_ids``' order: one pipeline per
        partition."""
        held: dict[str, bool] = {}
        for partition, ids in (await self._by_partition(job_ids)).items():
            pipe = partition.client.pipeline(transaction=False)
            for job_id in ids:
                pipe.exists(partition.keys.job(job_id))
            held.update(zip(ids, (bool(n) for n in await pipe.execute()), strict=True))
        return [held[job_id] for job_id in job_ids]

    async def _by_partition(self, job_ids: list[str]) -> dict[QueuePartition, list[str]]:
        count = await self._count()
        groups: dict[QueuePartition, list[str]] = {}
        for job_id in dict.fromkeys(job_ids):
            groups.setdefault(self._partition(partition_of(job_id, count)), []).append(job_id)
        return groups

    async def _read_partition_count(self) -> None:
        """The submits that find the count stale share one read of it."""
        reading = self._count_reading
        if reading is None or reading.done():
            reading = self._count_reading = asyncio.ensure_future(
                read_count(self._redis, self.keys)
            )
        self._partition_count = await asyncio.shield(reading)
        self._count_read_at = time.monotonic()

    def _partition(self, n: int) -> QueuePartition:
        found = self._partitions.get(n)
        if found is None:
            keys = self.keys.of_partition(n)
            client = client_like(self._redis, keys.jobs)
            pack_in_c(client.connection_pool)
            # Shard channels are subscribed on their slot's node; plain ones on any.
            router = router_for(client, keys) if self._router.sharded else self._router
            found = QueuePartition(
                client, router, keys, self.state_ttl_s, self.max_backlog, self._replicas
            )
            self._partitions[n] = found
        return found

    async def _partitions_for(self, job_id: str) -> list[QueuePartition]:
        """Where to look for job ``job_id``: the partition its id picks, then the others
        (a job submitted while the count was another), each made as it is asked for."""
        first = await self._partition_of(job_id)
        rest = [self._partition(n) for n in range(self._partition_count)]
        return [first, *(p for p in rest if p is not first)]

    async def get_result(self, job_id: str) -> JobResult | None:
        return await self._first_found(job_id, QueuePartition.get_result)

    async def status(self, job_id: str) -> JobStatus | None:
        return await self._first_found(job_id, QueuePartition.status)

    async def cancel(self, job_id: str) -> str:
        """Ask for the job to stop. Returns the state it had ('' if unknown)."""
        return await self._first_found(job_id, QueuePartition.cancel) or ""

    async def _first_found(
        self, job_id: str, ask: Callable[[QueuePartition, str], Awaitable[T]]
    ) -> T | None:
        """The first answer (not None, not empty) of the partitions _partitions_for names."""
        for partition in await self._partitions_for(job_id):
            found = await ask(partition, job_id)
            if found:
                return found
        return None


def _with_packed_ids(fields: dict[str, Any]) -> dict[str, Any]:
    """The fields with input_ids as input_ids_b64. Ids that do not pack (not a list of
    ints from 0 to 2**32 - 1) stay as they are, for the request's validation to name the
    one at fault."""
    rest = dict(fields)
    try:
        rest["input_ids_b64"] = PackedIds.from_ids(rest.pop("input_ids"))
    except (TypeError, ValueError):
        return fields
    return rest


def _wire_form(request: GenerationRequest) -> tuple[str, str]:
    """The job's id and the JSON a worker reads."""
    return request.id, request.model_dump_json(exclude_none=True)


def _log_retry(state: RetryCallState) -> None:
    error = state.outcome.exception() if state.outcome else None
    log.warning("reading a result failed (%s); retrying", error)

"""Worker: takes entries from the stream, feeds the engine, publishes what it makes."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import Awaitable, Callable, Iterable

from redis.exceptions import RedisError
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type

from exlq.protocol.backoff import REDIS_BACKOFF, reconnect_delay_s
from exlq.protocol.batch_script import PIECE_JOBS
from exlq.protocol.eager_task import started_task
from exlq.protocol.keys import Lane
from exlq.protocol.models import (
    SHARDED_EVENTS_VERSION,
    ErrorEvent,
    ErrorInfo,
    FinishReason,
    GenerationRequest,
    InvalidRequest,
    JobResult,
    parse_request,
)
from exlq.worker import job_log, tracing
from exlq.worker.broker import ENTRY_HEAD_BYTES, Broker, Read, StartDecision, StreamEntry
from exlq.worker.commit_batch import Batch, Final
from exlq.worker.engine_loop import EngineRunner, StepReport
from exlq.worker.engines.base import EngineOutput, JobEnded, JobErrored, TokenChunk
from exlq.worker.entry_ids import answerable_ids, closing_id, refuse_two_ids
from exlq.worker.gc_pauses import collections_deferred
from exlq.worker.job_state import (
    CANCELLED,
    FAILED,
    HELD,
    LOST,
    PUBLISHING,
    RUNNING,
    SKIPPED,
    JobBook,
    Piece,
    Stage,
)
from exlq.worker.lanes import TakePlan, count_by_lane
from exlq.worker.metrics import Metrics
from exlq.worker.running_job import RunningJob
from exlq.worker.settings import WorkerSettings
from exlq.worker.upkeep import Upkeep

log = logging.getLogger(__name__)

# A read's entries reach the engine in pieces of this many jobs, the size of the SDK's
# full submit pieces (the SDK writes a burst's first piece of this size in parts of 8, which
# _gather_burst reads into one): each piece is parsed, started and handed over before the
# next is parsed, so the engine starts prefilling a burst's first slice (the admission
# budget's 8,192 tokens hold 32 prompts of 256) while the worker takes in the rest. The
# whole burst in one piece: the first slice waited for every job to be parsed, started and
# piped.
ACCEPT_PIECE = PIECE_JOBS

# The jobs whose events a batch publishes, and so whose claims bound its lease.
_LEASED = PUBLISHING - {LOST}

EXIT_OK = 0
EXIT_ENGINE_DEAD = 3


class Worker:
    """Holds at most ``engine.capacity`` jobs: it reads only as many entries as it has free
    slots, so the backlog stays in Redis where other workers see it. Where each job is in
    its life is ``jobs``'s (job_state.JobBook) to know; the worker does the I/O around it:
    Redis, the events and results, the metrics."""

    def __init__(
        self, settings: WorkerSettings, engine: EngineRunner, broker: Broker, metrics: Metrics
    ) -> None:
        self.settings = settings
        self.engine = engine
        self.broker = broker
        self.metrics = metrics
        self.limits = settings.limits
        self.capacity = engine.capacity
        self.lanes = settings.lane_policy(self.capacity)
        self.jobs = JobBook(engine)
        self.exit_code = EXIT_OK
        self.clock_offset_s = 0.0
        self._reports: asyncio.Queue[StepReport] = asyncio.Queue()
        self._slot_freed = asyncio.Event()
        self.stop_reading = asyncio.Event()
        # Loops end on this as well as on cancellation: a library that swallows a
        # CancelledError mid-command must not keep a helper, and so the worker, alive.
        self.closing = asyncio.Event()
        self._engine_dead = asyncio.Event()
        self._redis_ok = False
        # One piece is taken in at a time, the read loop's or a reclaim's: a reclaim while
        # a read's piece waits for its start script would settle that piece's early starts
        # with its own verdict (job_state.Piece), and could take back its entries, idle
        # until the worker holds them.
        self._intake = asyncio.Lock()
        # One write at a time goes to Redis from here on: the news that Redis lost a job
        # (entries_lost) waits for a commit in flight, whose batch may hold that job's
        # last tokens, so that nothing of the job follows the news.
        self._writing = asyncio.Lock()
        # Token chunks published, for their metrics: (the job, its token before
        # this one, this one's time, the chunk).
        self._tokens_seen: list[tuple[RunningJob, float | None, float, TokenChunk]] = []
        # Since the worker started, for the heartbeat's rates (upkeep.Upkeep.heartbeat).
        self.jobs_ended = 0
        self.tokens_generated = 0

    @property
    def ready(self) -> bool:
        return self._redis_ok and not self.stop_reading.is_set() and not self._engine_dead.is_set()

    @property
    def free_slots(self) -> int:
        """Slots no job holds and no read in flight may fill."""
        return self.capacity - self.jobs.held - self.broker.reserved_slots

    def take_plan(self, slots: int, in_hand: Iterable[Lane] = ()) -> TakePlan:
        """The read for ``slots`` of the free slots, by lane (worker/lanes.py). ``in_hand``:
        the lanes of entries read and not yet held (a burst's piece), which count as
        running in their lane."""
        held = (job.lane for job in self.jobs.jobs_in(HELD))
        return self.lanes.plan(slots, count_by_lane(itertools.chain(held, in_hand)))

    @property
    def held(self) -> dict[str, RunningJob]:
        """The jobs that hold a slot, by id."""
        return {job.job_id: job for job in self.jobs.jobs_in(HELD)}

    @property
    def peak_held(self) -> int:
        return self.jobs.peak_held

    async def run(self, stop: asyncio.Event) -> int:
        """Serve until ``stop`` is set, then drain within the grace period. Returns the exit
        code: 0 after a clean stop, EXIT_ENGINE_DEAD if the engine died."""
        self.clock_offset_s = await self.broker.clock_offset_s()
        await self.broker.ensure_group()
        await self.broker.find_sharded_pubsub()
        self.set_redis_ok(True)
        # Each report is queued on this loop's thread (EngineProcess reads the pipe there).
        self.engine.start(self._reports.put_nowait, asyncio.get_running_loop())
        self.metrics.set_capacity(self.capacity)
        reader = asyncio.create_task(self._read_loop(), name="exlq-reader")
        helpers = [
            asyncio.create_task(self._publish_loop(), name="exlq-publisher"),
            asyncio.create_task(self._cancel_loop(), name="exlq-cancels"),
            asyncio.create_task(Upkeep(self).run(), name="exlq-upkeep"),
        ]
        self._publish_ready()
        log.info(
            "worker %s serving queue %r with capacity %d (engine %s)",
            self.broker.consumer,
            self.settings.queue_name,
            self.capacity,
            self.engine.name,
        )
        await _first_of(stop.wait(), self._engine_dead.wait())
        await self._shutdown(reader, helpers)
        return self.exit_code

    async def _shutdown(
        self, reader: asyncio.Task[None], helpers: list[asyncio.Task[None]]
    ) -> None:
        self.stop_reading.set()
        self._publish_ready()
        # Let an XREADGROUP in flight return: entries it brings are taken, not lost.
        await reader
        if not self._engine_dead.is_set() and self.jobs.held:
            log.info(
                "stopping: waiting up to %.0fs for %d running jobs",
                self.settings.serving.grace_seconds,
                self.jobs.held,
            )
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained(), self.settings.serving.grace_seconds)
        if self.jobs.held:
            log.warning("leaving %d unfinished jobs pending for another worker", self.jobs.held)
        await asyncio.to_thread(self.engine.stop, 30.0)
        self.closing.set()
        for task in helpers:
            task.cancel()
        await asyncio.gather(*helpers, return_exceptions=True)
        with contextlib.suppress(RedisError):
            await self.broker.leave()

    async def _drained(self) -> None:
        while self.jobs.held:
            self._slot_freed.clear()
            await self._slot_freed.wait()

    # -- taking jobs ---------------------------------------------------------------------

    async def _read_loop(self) -> None:
        failures = 0
        while not self.stop_reading.is_set():
            if self.free_slots <= 0 and not self.broker.reserved_slots:
                self._slot_freed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._slot_freed.wait(), 1.0)
                continue
            try:
                plan = self.take_plan(self.free_slots)
                read = await self.broker.read(
                    plan, plan.wait_ms(self.settings.broker.read_block_ms)
                )
                if read.entries:
                    # Redis answers a read with every entry that has landed, up to its
                    # count. One that stopped at its count (or waited, and brought the first
                    # alone) may have left some behind, and slots may have been freed while
                    # it waited: the rest is read into the same piece, so the engine starts
                    # the burst in one pass (_gather_burst; that read goes out before the
                    # worker parses). One that had them all goes to the engine without
                    # another round trip.
                    async with self._intake:
                        await self.accept(read.entries, read_behind=not read.complete)
                failures = 0
                self.set_redis_ok(True)
            except RedisError as exc:
                self.set_redis_ok(False)
                delay = reconnect_delay_s(failures)
                failures += 1
                log.warning("reading from Redis failed (%s); retrying in %.1fs", exc, delay)
                await asyncio.sleep(delay)
        # A partitioned queue's waits still in flight end within read_block_ms: what they
        # bring is taken, as a read in flight is.
        with contextlib.suppress(RedisError):
            left = await self.broker.finish_reads()
            if left:
                async with self._intake:
                    await self.accept(left)

    async def reclaim(self) -> None:
        """Take over entries whose worker stopped renewing them, as slots allow. An entry
        this worker holds (its renewal came late) is its own already: it is not started
        again."""
        async with self._intake:
            room = self.free_slots
            if room <= 0 and self.broker.reserved_slots and self.jobs.held < self.capacity:
                # A partitioned queue's waits in flight hold every free slot (a worker with
                # few slots): a stopped worker's job still gets one, though a wait may then
                # bring one job more than the worker's capacity, which the engine queues.
                room = 1
            if self.stop_reading.is_set() or room <= 0:
                return
            entries = await self.broker.reclaim(room, self.settings.broker.claim_idle_ms)
            held = {job.entry_id for job in self.jobs.jobs_in(HELD)}
            taken = [entry for entry in entries if entry.entry_id not in held]
            if taken:
                log.info("took over %d entries from stopped workers", len(taken))
                await self.accept(taken)

    async def accept(self, entries: list[StreamEntry], read_behind: bool = False) -> None:
        """Entries this worker now owns (read or reclaimed): reject, skip, end or run each,
        in pieces of ACCEPT_PIECE, in order. ``read_behind``: entries a read returned that
        may have more behind them, which their piece, if not full, takes in. The caller
        holds ``_intake``."""
        for start in range(0, len(entries), ACCEPT_PIECE):
            piece = entries[start : start + ACCEPT_PIECE]
            await self._accept_piece(piece, read_behind and len(piece) < ACCEPT_PIECE)

    async def _accept_piece(self, entries: list[StreamEntry], read_behind: bool = False) -> None:
        if tracing.tracer is not None:
            tracing.tracer.stage("piece_begun", n=len(entries))
        batch = Batch()
        # The engine readies the piece's jobs while the worker parses the rest and starts
        # them before the start script answers (job_state.Piece).
        piece = self.jobs.piece()
        # No collection pauses the piece's way to the engine (gc_pauses): what falls due
        # runs after the hand-over, while the engine steps.
        with collections_deferred():
            try:
                if entries[-1].more or read_behind:
                    await self._gather_burst(entries, batch, piece)
                else:
                    self._take_in(entries, batch, piece)
                # The engine starts the piece now; the script's refusals stop after.
                piece.start_early(time.time())
                await self._start_piece(batch, piece)
            except BaseException:
                piece.withdraw()  # the entries stay pending in Redis
                raise
            # One hand-over: what the verdict runs and was not started early starts in one
            # pass; what it refused, started early, stops.
            piece.hand_over()
        self._note_held()
        if batch:
            await self.commit(batch)

    def _take_in(self, entries: list[StreamEntry], batch: Batch, piece: Piece) -> None:
        """Parse each entry: a bad one is settled into ``batch``, a good one joins the
        piece, which offers it to the engine."""
        for entry in entries:
            self.metrics.job_received(entry.lane)
            try:
                request = self._decode(entry)
            except InvalidRequest as exc:
                self._reject(batch, entry, str(exc))
                continue
            if tracing.tracer is not None:
                tracing.tracer.stage("job_parsed")
            job = RunningJob(
                job_id=request.id,
                entry_id=entry.entry_id,
                request=request,
                channel=self.broker.keys_of(entry.entry_id).channel(request.id, request.v),
                enqueued_at=entry.enqueued_at_server - self.clock_offset_s,
                claimed_at=entry.claimed_at,
            )
            job_log.job_taken(job, self.broker.keys.queue)
            piece.take(job)

    async def _gather_burst(self, entries: list[StreamEntry], batch: Batch, piece: Piece) -> None:
        """Take the piece in, and read what lands behind it into the piece, up to its full
        size and the free slots. The piece's last entry says more of its burst follows:
        each read blocks, and the wait ends after burst_wait_ms. Otherwise (a read that
        returned its count, its piece not full) one read takes what has landed, without
        blocking. Each read goes out before the worker parses what the last one brought, so
        Redis answers while the worker parses, and the engine readies the jobs offered so
        far meanwhile; a read whose last entry says more is followed by a blocking one. A
        full piece (a read's earlier pieces are full) reads nothing; reclaimed entries carry
        no mark. A read that fails, or a stop, ends the wait: the jobs taken still run, and
        the next read meets the error. Every read sent is awaited and its entries taken in,
        unless the piece fails (a parse raises, the worker is cancelled): then the read in
        flight is cancelled, and what Redis had delivered to it stays pending for a reclaim,
        with the rest of the piece."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settings.broker.burst_wait_ms / 1000
        in_hand, rest = [entry.lane for entry in entries], entries
        read = await self._read_ahead(in_hand, deadline, block=entries[-1].more)
        try:
            while True:
                self._take_in(rest, batch, piece)
                if read is None:
                    return
                piece.flush()
                try:
                    rest = (await read).entries
                except RedisError:
                    return
                if not rest:
                    return
                in_hand += [entry.lane for entry in rest]
                read = await self._read_ahead(in_hand, deadline) if rest[-1].more else None
        finally:
            if read is not None and not read.done():  # cancelled, or a parse failed
                read.cancel()

    async def _read_ahead(
        self, in_hand: list[Lane], deadline: float, block: bool = True
    ) -> asyncio.Task[Read] | None:
        """Send the read for the rest of a piece whose entries in hand are of the lanes
        ``in_hand`` (``block``: waiting until ``deadline``, else only what has landed); None
        when the piece is full, the wait is over or the worker stops reading. The entries in
        hand count in their lanes' bounds (worker/lanes.py), as the jobs held do."""
        room = min(ACCEPT_PIECE, self.free_slots) - len(in_hand)
        if room <= 0 or self.stop_reading.is_set():
            return None
        wait_ms: int | None = None
        if block:
            wait_ms = int((deadline - asyncio.get_running_loop().time()) * 1000)
            if wait_ms < 1:  # BLOCK 0 would wait for ever
                return None
        read = self.broker.read(self.take_plan(room, in_hand), wait_ms)
        return await started_task(read, name="exlq-burst-read")

    async def _start_piece(self, batch: Batch, piece: Piece) -> None:
        """Run the start script for the piece's jobs; settle those it refuses (into
        ``batch``) and run the others."""
        decisions = await self.broker.start_jobs([(job.job_id, job.entry_id) for job in piece.jobs])
        if tracing.tracer is not None:
            tracing.tracer.stage("piece_started", n=len(piece.jobs))
        now = time.time()
        for job, decision in zip(piece.jobs, decisions, strict=True):
            piece.judged(job, decision.attempt, now)
            self._start(batch, piece, job, decision, now)

    def _decode(self, entry: StreamEntry) -> GenerationRequest:
        if entry.payload is None:
            raise InvalidRequest("request: the stream entry has no 'job' field")
        self.limits.check_size(entry.size)
        request = parse_request(entry.payload)
        self.limits.check(request)
        if request.v >= SHARDED_EVENTS_VERSION and not self.broker.sharded_pubsub:
            raise InvalidRequest(
                f"v: {request.v} asks for the job's events on its queue's shard channel, which "
                "needs sharded pub/sub (Redis >= 7); this Redis has none: send v 1"
            )
        refuse_two_ids(entry.payload)
        return request

    def _start(
        self, batch: Batch, piece: Piece, job: RunningJob, decision: StartDecision, now: float
    ) -> None:
        """Run the job, or settle it here as its verdict says."""
        stage = self._judge(batch, piece, job, decision, now)
        if stage is RUNNING:
            job_log.job_started(job, self.broker.keys.queue)
            self.metrics.observe_queue_wait(job.started_at - job.enqueued_at, job.lane)
            piece.run(job)
        else:
            piece.settle(job, stage)

    def _judge(
        self, batch: Batch, piece: Piece, job: RunningJob, decision: StartDecision, now: float
    ) -> Stage:
        """Where the start script's verdict puts the job: RUNNING, or the stage it settles
        in, what it ends with written into ``batch``. A retry is announced first."""
        if decision.verdict == "error":
            self._unstartable(batch, job, decision.detail)
            return FAILED
        if decision.verdict == "ended":
            self._ended_already(batch, job, decision.detail)
            return FAILED
        if decision.verdict == "duplicate" or piece.held_elsewhere(job):
            self._skip(batch, job, decision)
            return SKIPPED
        if job.attempt > 1:
            batch.publish(
                job.channel, job.requeued_event("its previous worker stopped"), job.entry_id
            )
            self.metrics.job_requeued()
        max_attempts = self.settings.broker.max_attempts
        if job.attempt > max_attempts:
            message = (
                f"gave up after {job.attempt - 1} attempts (EXLQ_MAX_ATTEMPTS="
                f"{max_attempts}); every worker that ran it stopped"
            )
            self._fail(batch, job, JobErrored(job.job_id, "too_many_attempts", message), now)
            return FAILED
        if decision.verdict == "cancel" or job.request.past_deadline(now):
            reason: FinishReason = "cancelled" if decision.verdict == "cancel" else "expired"
            self._finish(batch, job, JobEnded(job.job_id, reason, 0, 0), now)
            return CANCELLED
        return RUNNING

    def _skip(self, batch: Batch, job: RunningJob, decision: StartDecision) -> None:
        """An entry whose job runs under another entry (a producer's retried XADD, say):
        acked, nothing written; that entry's events answer the job's subscribers."""
        detail = (
            f"entry {decision.detail} runs it"
            if decision.verdict == "duplicate"
            else "its job runs here under another entry"
        )
        log.info("skipping entry %s of job %s: %s", job.entry_id, job.job_id, detail)
        batch.finish(Final(job.entry_id))

    def _ended_already(self, batch: Batch, job: RunningJob, state: str) -> None:
        """An entry naming a job that has ended: an id runs once (the SDK's submit of an
        existing id hands back that job), so it does not run again. Whoever sent it hears
        why on the job's channel, and a dead-letter entry keeps it; the job's result and
        state stay as they are."""
        message = (
            f"job {job.job_id} ended already ({state}); an id runs once: "
            "submit the job under a new id to run it again"
        )
        log.warning("entry %s not run: %s", job.entry_id, message)
        self._answer_unrun(batch, job, ErrorInfo(code="duplicate_id", message=message), 0)

    def _unstartable(self, batch: Batch, job: RunningJob, redis_error: str) -> None:
        """The start script failed on this job's state key (say it holds another type): an
        error event and a dead-letter entry, then the ack. The key itself is left alone, so
        nothing else the worker writes fails on it."""
        key = self.broker.keys_of(job.entry_id).job(job.job_id)
        message = (
            f"cannot start the job: its state key {key} is unusable ({redis_error}); "
            "delete that key, or submit the job under another id"
        )
        log.warning("entry %s of job %s: %s", job.entry_id, job.job_id, message)
        self._answer_unrun(batch, job, ErrorInfo(code="internal_error", message=message), 1)

    def _answer_unrun(self, batch: Batch, job: RunningJob, error: ErrorInfo, attempts: int) -> None:
        """An entry the start script would not run: an error event on its job's channel and
        a dead-letter entry, then the ack; the job's result and state are not written."""
        event = ErrorEvent(id=job.job_id, seq=0, attempt=1, error=error)
        dead = self._dead_fields(
            job.entry_id, job.request.model_dump_json().encode(), error, attempts
        )
        batch.finish(
            Final(job.entry_id, channel=job.channel, event_json=event.model_dump_json(), dead=dead)
        )
        self.metrics.job_failed(error.code)

    def _reject(self, batch: Batch, entry: StreamEntry, message: str) -> None:
        """An entry that can never run: an error event and a failed result for each usable
        id it names at its top level (read without a parse: it may be what no parse reads),
        one dead-letter entry, one ack."""
        log.warning("rejecting entry %s: %s", entry.entry_id, message)
        error = ErrorInfo(code="invalid_request", message=message)
        # A refused entry cannot run again as it is: its dead letter keeps a head of it,
        # enough to see what was sent, and its size (docs/SECURITY.md).
        head = (entry.payload or b"")[:ENTRY_HEAD_BYTES]
        dead = self._dead_fields(entry.entry_id, head, error, attempts=1)
        dead["job_bytes"] = str(entry.size)
        answers = [
            Final(
                entry.entry_id,
                job_id=job_id,
                state="failed",
                result_json=JobResult(
                    id=job_id, state="failed", error=error, attempts=1
                ).model_dump_json(),
                channel=self.broker.keys.events(job_id),
                event_json=ErrorEvent(id=job_id, seq=0, attempt=1, error=error).model_dump_json(),
                guard=True,
                ack=False,
            )
            for job_id in answerable_ids(entry.payload) or closing_id(entry.tail)
        ]
        # The entry's one dead letter and ack ride on its last final, written after the
        # others: the commit script writes a final only while the entry is still owned.
        last = answers.pop() if answers else Final(entry.entry_id)
        for answer in answers:
            batch.finish(answer)
        batch.finish(dataclasses.replace(last, dead=dead, ack=True))
        self.metrics.job_failed("invalid_request")

    def _dead_fields(
        self, entry_id: str, payload: bytes | None, error: ErrorInfo, attempts: int
    ) -> dict[str, str]:
        self.metrics.dead_lettered()
        return {
            "entry": entry_id,
            "job": (payload or b"")[: self.limits.max_request_bytes].decode(errors="replace"),
            "error": error.code,
            "message": error.message,
            "attempts": str(attempts),
            "worker": self.broker.consumer,
            "failed_at": f"{time.time():.3f}",
        }

    # -- publishing ----------------------------------------------------------------------

    async def _publish_loop(self) -> None:
        while not self.closing.is_set():
            reports = [await self._reports.get()]
            while not self._reports.empty():  # coalesce steps that queued up meanwhile
                reports.append(self._reports.get_nowait())
            if self.jobs.awaiting_verdict:  # output of a job started early waits for it
                await self.jobs.verdicts_for(reports)
            batch = Batch()
            ended: list[RunningJob] = []
            for report in reports:
                self._take_report(batch, report, ended)
            if batch:
                batch.lease_until_ms = self._lease_until_ms()
                # The events go out first; the token metrics are observed while Redis
                # answers, where a burst's first events would otherwise wait for them.
                commit = await started_task(self.commit(batch), name="exlq-commit")
                self._observe_tokens()
                try:
                    await commit
                except asyncio.CancelledError:
                    commit.cancel()
                    raise
            else:
                self._observe_tokens()
            if ended:
                for job in ended:
                    self.jobs.commit(job)
                self._slot_freed.set()
                self._note_held()

    def _lease_until_ms(self) -> int:
        """Redis time until which no other worker can have taken an entry of a job this
        worker publishes for: the oldest claim, plus three quarters of the claim idle time
        (renewals come every quarter). Past it, the commit script checks each event's entry
        before publishing it: a worker paused past the idle time (SIGSTOP, a stalled host)
        must not publish for jobs another worker reran meanwhile."""
        claims = [job.claimed_at for job in self.jobs.jobs_in(_LEASED)]
        if not claims:
            return 0
        valid_s = self.settings.broker.claim_idle_ms / 1000 * 0.75
        return int((min(claims) + valid_s + self.clock_offset_s) * 1000)

    def _take_report(self, batch: Batch, report: StepReport, ended: list[RunningJob]) -> None:
        if tracing.tracer is not None:
            tracing.tracer.stage("report_received", outputs=len(report.outputs))
        if report.fatal is not None:
            log.critical("engine died (%s); exiting so the jobs run elsewhere", report.fatal)
            self.exit_code = EXIT_ENGINE_DEAD
            self._engine_dead.set()
            return
        if report.step_seconds is not None:
            self.metrics.observe_step(report.step_seconds)
        self.metrics.set_cache_pages(report.cache.pages_used, report.cache.pages_total)
        # Output of jobs the start script refused after the engine started them is dropped;
        # the check costs the per-token path nothing while there are none.
        drops = self.jobs.drops if self.jobs.dropping else None
        get = self.jobs.get
        for output in report.outputs:
            if drops is not None and drops(output):
                continue
            job = get(output.job_id)
            if job is None or job.stage not in PUBLISHING:
                log.error("engine output for unknown job %s dropped", output.job_id)
                continue
            self._take_output(batch, job, output, report.finished_at, ended)

    def _take_output(
        self,
        batch: Batch,
        job: RunningJob,
        output: EngineOutput,
        now: float,
        ended: list[RunningJob],
    ) -> None:
        # A lost job's entry is another worker's now: it writes the events and the result.
        lost = job.stage is LOST
        if isinstance(output, TokenChunk):
            if not lost:
                self._tokens_seen.append((job, job.last_token_at, now, output))
                batch.publish(job.channel, job.token_event(output, now), job.entry_id)
            return
        self.jobs.end(job)
        ended.append(job)
        if lost:
            return
        if isinstance(output, JobEnded):
            self._finish(batch, job, output, now)
            self.metrics.job_tokens(
                output.prompt_tokens, output.completion_tokens, output.cached_tokens
            )
            if output.draft_tokens is not None:
                self.metrics.drafts(output.draft_tokens, output.accepted_draft_tokens or 0)
        else:
            self._fail(batch, job, output, now)

    def _observe_tokens(self) -> None:
        """The token metrics of the chunks taken since the last call."""
        seen, self._tokens_seen = self._tokens_seen, []
        generated = 0
        for job, previous, now, chunk in seen:
            generated += len(chunk.token_ids)
            if previous is None:
                self.metrics.observe_ttft(now - job.enqueued_at, job.lane)
            elif chunk.token_ids:
                gap = (now - previous) / len(chunk.token_ids)
                for _ in chunk.token_ids:
                    self.metrics.observe_inter_token(gap)
        # One add for the chunks together: the counter's lock and call once, not per chunk.
        self.tokens_generated += generated
        if generated:
            self.metrics.add_generated_tokens(generated)

    def _finish(self, batch: Batch, job: RunningJob, ended: JobEnded, now: float) -> None:
        state, event_json, result_json = job.finish(ended, now)
        batch.finish(
            Final(
                job.entry_id,
                job_id=job.job_id,
                state=state,
                result_json=result_json,
                channel=job.channel,
                event_json=event_json,
            )
        )
        self.metrics.job_completed(job.stop_reason or ended.finish_reason, job.lane)
        self.metrics.observe_duration(now - job.enqueued_at)
        self.jobs_ended += 1
        job_log.job_ended(job, self.broker.keys.queue, ended, now)

    def _fail(self, batch: Batch, job: RunningJob, errored: JobErrored, now: float) -> None:
        log.warning("job %s failed (%s): %s", job.job_id, errored.code, errored.message)
        event_json, result_json = job.fail(errored.code, errored.message, now)
        error = ErrorInfo(code=errored.code, message=errored.message)
        dead = self._dead_fields(
            job.entry_id, job.request.model_dump_json().encode(), error, job.attempt
        )
        batch.finish(
            Final(
                job.entry_id,
                job_id=job.job_id,
                state="failed",
                result_json=result_json,
                channel=job.channel,
                event_json=event_json,
                dead=dead,
            )
        )
        self.metrics.job_failed(errored.code)
        self.jobs_ended += 1
        job_log.job_ended(job, self.broker.keys.queue, errored, now)

    async def commit(self, batch: Batch) -> None:
        """Write a batch, retrying through Redis outages: a lost batch would lose events.
        A batch sent again publishes nothing twice (broker.Broker.commit)."""
        if tracing.tracer is not None:
            tracing.tracer.stage("commit_begun")
        async with self._writing:
            try:
                # Tried once without the retry machinery first: building tenacity's loop
                # would cost every commit, on the way of every token, and a commit seldom
                # needs it.
                unwritten = await self.broker.commit(batch)
            except RedisError as exc:
                self.set_redis_ok(False)
                log.warning("writing to Redis failed (%s); retrying", exc)
                unwritten = await self._commit_retrying(batch)
        if tracing.tracer is not None:
            tracing.tracer.stage("commit_ended")
        self.set_redis_ok(True)
        if unwritten:
            await self.entries_lost(unwritten)

    async def _commit_retrying(self, batch: Batch) -> list[tuple[str, str]]:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception_type(RedisError),
            wait=REDIS_BACKOFF,
            before_sleep=self._on_redis_retry("writing to Redis"),
        ):
            with attempt:
                unwritten = await self.broker.commit(batch)
        return unwritten

    def _on_redis_retry(self, what: str) -> Callable[[RetryCallState], None]:
        def report(state: RetryCallState) -> None:
            self.set_redis_ok(False)
            delay = state.next_action.sleep if state.next_action else 0.0
            error = state.outcome.exception() if state.outcome else None
            log.warning(
                "%s failed (%s); retry %d in %.1fs", what, error, state.attempt_number, delay
            )

        return report

    # -- cancellation --------------------------------------------------------------------

    async def _cancel_loop(self) -> None:
        await forever(self._listen_for_cancels, "cancel listener", self.closing)

    async def _listen_for_cancels(self) -> None:
        async for job_id in self.broker.cancel_requests():
            self.cancel(job_id)

    def cancel(self, job_id: str, reason: FinishReason | None = None) -> None:
        """Stop a running job within one engine step."""
        self.jobs.stop(job_id, reason)

    async def entries_lost(self, unwritten: list[tuple[str, str]]) -> None:
        """Entries whose writes Redis did not take, with why. 'taken': another worker took
        the entry over (this one was paused, or missed its renewals): its jobs stop here,
        and the new owner writes their events and results. 'gone': Redis no longer holds
        the entry (a restart without persistence, a flush): its jobs stop, and where the
        job's state is gone too, its subscribers hear an error event, code ``lost``."""
        for entry_id, why in unwritten:
            if why.startswith("error"):
                log.error("Redis refused the final writes of entry %s (%s)", entry_id, why)
        taken = [entry for entry, why in unwritten if why == "taken"]
        for job in self.jobs.lose(taken):
            log.warning("job %s was taken over by another worker; stopping it here", job.job_id)
        gone = {entry for entry, why in unwritten if why == "gone"}
        for job in self.jobs.lose(gone):
            log.warning("Redis lost job %s (entry %s); stopping it here", job.job_id, job.entry_id)
        # An ended job's final went unwritten too: its subscribers are owed the news as well.
        if not gone:
            return
        async with self._writing:  # a renewal and a commit may both find the entry gone
            for job in self.jobs.jobs_in(HELD):
                if job.entry_id not in gone or job.lost_announced:
                    continue
                job.lost_announced = True
                event = job.lost_event(self.broker.consumer)
                if await self.broker.announce_lost(job.job_id, job.entry_id, job.channel, event):
                    self.metrics.job_failed("lost")

    # -- state ---------------------------------------------------------------------------

    def _note_held(self) -> None:
        self.metrics.set_running(count_by_lane(job.lane for job in self.jobs.jobs_in(HELD)))

    def set_redis_ok(self, ok: bool) -> None:
        if ok != self._redis_ok:
            self._redis_ok = ok
            self._publish_ready()

    def _publish_ready(self) -> None:
        self.metrics.set_redis_connected(self._redis_ok)
        self.metrics.set_ready(self.ready)


async def _first_of(*waits: Awaitable[object]) -> None:
    tasks = [asyncio.ensure_future(w) for w in waits]
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in tasks:
            task.cancel()


async def forever(
    body: Callable[[], Awaitable[None]],
    what: str,
    closing: asyncio.Event,
) -> None:
    """Run ``body`` again whenever it ends or fails, backing off while Redis is away (the
    read loop says whether the worker is ready; cancels are polled meanwhile)."""
    failures = 0
    while not closing.is_set():
        try:
            await body()
            failures = 0
        except RedisError as exc:
            log.warning("%s lost Redis (%s); reconnecting", what, exc)
            failures += 1
        await asyncio.sleep(reconnect_delay_s(failures))

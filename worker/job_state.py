"""The life of a job in a worker, in one place: its stages, the moves allowed between them
(NEXT), the one function that moves a job (move), and JobBook, which holds every job and
says what each move means for the engine.

A job's life here begins when an entry this worker owns (read, or reclaimed) parses into a
valid request; an entry that does not is rejected before it is a job. The jobs of one piece
are taken in together (Piece): each is offered to the engine as it is parsed, all are
started before Redis's start script answers, and the script's verdict then runs each or
settles it. A running job holds a slot until its end, from the engine, is committed:

    PARSED -> OFFERED -> STARTED -> RUNNING ------------------------> ENDED -> COMMITTED
                                       +-> STOPPING (cancel, deadline) --^
                                       +-> LOST (entry taken over) -----^
                                           (nothing written for it)

and the verdict may instead settle a job that never ran, out of the book: SKIPPED (another
entry runs it), FAILED (its id ended already, its state key is unusable, or it ran out of
attempts), CANCELLED (cancelled, or past its deadline), or WITHDRAWN (the script
failed: the entry stays pending, for a reclaim). A job started early and then settled is
stopped in the engine, and what the engine made of it is dropped up to its end.

Every job the engine starts ends with exactly one end output, and reports arrive in order:
so output of a dropped job is dropped up to and including its end, and output of the same
id after that is a later start's (a reclaim of the same entry, say).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Iterable
from enum import IntEnum
from typing import TYPE_CHECKING

from exlq.protocol.models import FinishReason
from exlq.worker.engines.base import EngineOutput, TokenChunk
from exlq.worker.offer_round import OfferRound

if TYPE_CHECKING:
    from exlq.worker.engine_loop import EngineRunner, StepReport
    from exlq.worker.running_job import RunningJob

log = logging.getLogger(__name__)


class Stage(IntEnum):
    """Where a job is in this worker. In the book from OFFERED to ENDED (PARSED: a job whose
    id another job of this worker holds stays out of it); the last five leave it."""

    PARSED = 0  # a valid request from an entry this worker owns; the engine knows nothing
    OFFERED = 1  # offered to the engine in its piece's round: readied there, not running
    STARTED = 2  # admitted before the start script's verdict; its output waits for that
    RUNNING = 3  # the script started it: it holds a slot, its output is published
    STOPPING = 4  # the worker asked the engine to stop it (cancel, deadline); its end comes
    LOST = 5  # another worker took its entry over: stopping, and nothing is written for it
    ENDED = 6  # the engine ended it; its final is in the batch being committed
    SKIPPED = 7  # the script: another entry runs it; acked only
    FAILED = 8  # its id ended, its state key is unusable, or attempts ran out; dead-lettered
    CANCELLED = 9  # cancelled, or past its deadline, before it ran; ended as such
    WITHDRAWN = 10  # no verdict (the script failed, the worker stops): the entry stays pending
    COMMITTED = 11  # its final is written (a lost job's is another worker's): its slot is free


# Each stage by its name alone, for the code on every job's path: a member read through
# its enum class goes through the enum's metaclass, a slower lookup than a global's.
PARSED = Stage.PARSED
OFFERED = Stage.OFFERED
STARTED = Stage.STARTED
RUNNING = Stage.RUNNING
STOPPING = Stage.STOPPING
LOST = Stage.LOST
ENDED = Stage.ENDED
SKIPPED = Stage.SKIPPED
FAILED = Stage.FAILED
CANCELLED = Stage.CANCELLED
WITHDRAWN = Stage.WITHDRAWN
COMMITTED = Stage.COMMITTED

_SETTLED = frozenset({SKIPPED, FAILED, CANCELLED, WITHDRAWN})

# Every move a job may make; any other raises IllegalTransition.
NEXT: dict[Stage, frozenset[Stage]] = {
    # A job whose id another job holds stays PARSED until the verdict settles it.
    PARSED: frozenset({OFFERED}) | _SETTLED,
    # A job is started early unless its deadline passed; the verdict's admit starts one
    # whose deadline the clock then puts back in the future.
    OFFERED: frozenset({STARTED, RUNNING}) | _SETTLED,
    STARTED: frozenset({RUNNING}) | _SETTLED,
    RUNNING: frozenset({STOPPING, LOST, ENDED}),
    STOPPING: frozenset({LOST, ENDED}),
    LOST: frozenset({ENDED}),
    ENDED: frozenset({COMMITTED}),
    SKIPPED: frozenset(),
    FAILED: frozenset(),
    CANCELLED: frozenset(),
    WITHDRAWN: frozenset(),
    COMMITTED: frozenset(),
}
# Stages whose jobs the engine runs under the worker's eye: their output is taken.
PUBLISHING = frozenset({RUNNING, STOPPING, LOST})
# Stages that hold a slot.
HELD = PUBLISHING | {ENDED}


class IllegalTransition(RuntimeError):
    """A job asked to make a move NEXT does not allow: a fault in the worker."""

    def __init__(self, job_id: str, stage: Stage, to: Stage) -> None:
        super().__init__(f"job {job_id}: no move from {stage.name} to {to.name}")
        self.job_id, self.stage, self.to = job_id, stage, to


def move(job: RunningJob, to: Stage) -> None:
    """The one place a job changes stage. JobBook and Piece call it, and keep what the move
    means for the engine and for the book."""
    if to not in NEXT[job.stage]:
        raise IllegalTransition(job.job_id, job.stage, to)
    job.stage = to


class JobBook:
    """Every job of this worker from its offer to its end's commit, by id; the jobs whose
    output is dropped; the wait of output for its job's verdict."""

    def __init__(self, engine: EngineRunner) -> None:
        self.engine = engine
        self._jobs: dict[str, RunningJob] = {}
        # A job by its id, or None: the dict's own get, called for every output of a step.
        self.get: Callable[[str], RunningJob | None] = self._jobs.get
        self.held = 0  # jobs in a HELD stage: the slots in use
        self.peak_held = 0
        # Ends still to drop, by id: jobs stopped in the engine after an early start.
        self.dropping: dict[str, int] = {}
        self._awaiting = 0  # jobs STARTED: their output waits for their verdict
        self._settled = asyncio.Event()
        self._settled.set()
        self._rounds = itertools.count()  # the ids of the pieces offered to the engine

    def jobs_in(self, stages: frozenset[Stage]) -> list[RunningJob]:
        return [job for job in self._jobs.values() if job.stage in stages]

    @property
    def awaiting_verdict(self) -> bool:
        return self._awaiting > 0

    def piece(self) -> Piece:
        """The intake of the next piece. One piece at a time: its verdict settles every job
        it started early, so a piece begun before the last one's verdict is a fault."""
        if self._awaiting:
            raise RuntimeError("a piece's early starts began while another's wait for a verdict")
        return Piece(self, OfferRound(self.engine, next(self._rounds)))

    # -- a running job ------------------------------------------------------------------

    def stop(self, job_id: str, reason: FinishReason | None = None) -> bool:
        """Ask the engine to stop a running job (within one step); False if none runs under
        that id or it is stopping already."""
        job = self._jobs.get(job_id)
        if job is None or job.stage is not RUNNING:
            return False
        log.info("stopping job %s (%s)", job_id, reason or "cancelled")
        move(job, STOPPING)
        if reason is not None:
            job.stop_reason = reason
        self.engine.cancel(job_id)
        return True

    def lose(self, entry_ids: Iterable[str]) -> list[RunningJob]:
        """Another worker took these entries over: stop their jobs here, and write nothing
        for them (an ended job's final is already on its way: the commit script checks)."""
        lost = set(entry_ids)
        taken = [j for j in self._jobs.values() if j.entry_id in lost and j.stage in _LOSABLE]
        for job in taken:
            running = job.stage is RUNNING
            move(job, LOST)
            if running:  # a stopping job's cancel is sent already
                self.engine.cancel(job.job_id)
        return taken

    def end(self, job: RunningJob) -> None:
        """The engine's end of a job came (done, cancelled or failed)."""
        move(job, ENDED)

    def commit(self, job: RunningJob) -> None:
        """Its end is committed: the job leaves the book, its slot free."""
        move(job, COMMITTED)
        del self._jobs[job.job_id]
        self.held -= 1

    # -- output of jobs started early ------------------------------------------------------

    def drops(self, output: EngineOutput) -> bool:
        """Whether ``output`` belongs to a job stopped after an early start (and so is
        dropped); its end ends the dropping."""
        left = self.dropping.get(output.job_id)
        if left is None:
            return False
        if not isinstance(output, TokenChunk):
            if left > 1:
                self.dropping[output.job_id] = left - 1
            else:
                del self.dropping[output.job_id]
        return True

    async def verdicts_for(self, reports: list[StepReport]) -> None:
        """Wait until no output of ``reports`` belongs to a job waiting for its verdict."""
        while self._awaiting and any(
            self._awaits_verdict(output.job_id) for report in reports for output in report.outputs
        ):
            await self._settled.wait()

    def _awaits_verdict(self, job_id: str) -> bool:
        job = self._jobs.get(job_id)
        return job is not None and job.stage is STARTED

    # -- for Piece ----------------------------------------------------------------------

    def _offered(self, job: RunningJob) -> bool:
        """Take a parsed job into the book, unless its id is another job's here."""
        if job.job_id in self._jobs:
            return False
        move(job, OFFERED)
        self._jobs[job.job_id] = job
        return True

    def _started_early(self, job: RunningJob, now: float) -> None:
        move(job, STARTED)
        job.started_at = now
        self._awaiting += 1
        self._settled.clear()

    def _runs(self, job: RunningJob) -> bool:
        """The verdict starts it: True if it must still be started in the engine."""
        early = job.stage is STARTED
        move(job, RUNNING)
        self.held += 1
        self.peak_held = max(self.peak_held, self.held)
        if early:
            self._verdict_taken()
        return not early

    def _settles(self, job: RunningJob, to: Stage) -> bool:
        """It leaves the book without running: True if the engine started it early, and so
        must stop it."""
        early = job.stage is STARTED
        move(job, to)
        if self._jobs.get(job.job_id) is job:  # not another job of the same id
            del self._jobs[job.job_id]
        if early:
            self.dropping[job.job_id] = self.dropping.get(job.job_id, 0) + 1
            self._verdict_taken()
        return early

    def _verdict_taken(self) -> None:
        self._awaiting -= 1
        if not self._awaiting:
            self._settled.set()


_LOSABLE = frozenset({RUNNING, STOPPING})


class Piece:
    """One piece's jobs from their parse to the start script's verdict, in order: each
    offered to the engine as it is taken in, all started before the verdict
    (start_early), then run or settled by it and handed over (hand_over); or, without a
    verdict, withdrawn."""

    def __init__(self, book: JobBook, round_: OfferRound) -> None:
        self.book = book
        self.jobs: list[RunningJob] = []
        self._round = round_
        self._late: list[RunningJob] = []  # run by the verdict, not started early
        self._refused: list[str] = []  # started early, then settled: stopped after the admit

    def take(self, job: RunningJob) -> None:
        """A parsed job: offered to the engine unless another job of this worker holds its
        id (that one runs under it already)."""
        self.jobs.append(job)
        if self.book._offered(job):
            self._round.offer(job.job_id, job.request)

    def flush(self) -> None:
        """Send what was offered so far (before waiting on Redis)."""
        self._round.flush()

    def start_early(self, now: float) -> list[str]:
        """Start every offered job, in order, before the start script's verdict; a job whose
        deadline has passed is left to the verdict (it ends as expired). Returns the ids."""
        started = []
        for job in self.jobs:
            if job.stage is OFFERED and not job.request.past_deadline(now):
                self.book._started_early(job, now)
                started.append(job.job_id)
        self._round.start(started)
        return started

    def judged(self, job: RunningJob, attempt: int, now: float) -> None:
        """The verdict on ``job`` is in (the attempt it counts, 1 where it counted none):
        a job not started early starts now, as far as its timings go."""
        job.attempt = max(attempt, 1)
        if job.stage is not STARTED:
            job.started_at = now

    def held_elsewhere(self, job: RunningJob) -> bool:
        """Whether another job of this worker holds ``job``'s id (it was never offered)."""
        return job.stage is PARSED

    def run(self, job: RunningJob) -> None:
        """The verdict starts ``job``: it holds a slot from now on."""
        if self.book._runs(job):
            self._late.append(job)

    def settle(self, job: RunningJob, to: Stage) -> None:
        """The verdict ends ``job`` without running it (``to``: one of the settled stages);
        the caller wrote what it ends with."""
        if self.book._settles(job, to):
            self._refused.append(job.job_id)

    def hand_over(self) -> None:
        """After the verdict: start what it runs and was not started early, in one pass
        (whole: the early start used the round's offers up), then stop what it refused."""
        late, self._late = self._late, []
        refused, self._refused = self._refused, []
        self._round.start_whole([(job.job_id, job.request) for job in late])
        for job_id in refused:
            self.book.engine.cancel(job_id)

    def withdraw(self) -> None:
        """No verdict (the script failed, or the worker is cancelled): none of the jobs still
        waiting for one runs here; their entries stay pending in Redis for a reclaim, and
        what of them was started early is stopped. Jobs judged already are handed over."""
        self._round.withdraw()
        for job in self.jobs:
            if job.stage in _UNJUDGED:
                self.settle(job, WITHDRAWN)
        self.hand_over()


_UNJUDGED = frozenset({PARSED, OFFERED, STARTED})

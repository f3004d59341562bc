"""EarlyStarts: a piece's offered jobs started before Redis's start script answers.

The start script (broker.start_jobs) decides which of a piece's jobs this worker runs: a
duplicate, an ended, a cancelled job, one past its attempts does not. With
--admit-before-start the worker admits the offered jobs to the engine as soon as the last
part is offered, and runs the script meanwhile: the burst's first step no longer waits
for that round trip (about 1 ms at 32 jobs on the H100's host). What the script refuses
is then stopped in the engine, and whatever it made is dropped unseen: no event, no
metric, nothing in Redis. A job's events still go out only after the script started it:
a report that carries output of a job still waiting for its verdict waits with it.

The starts of one piece at a time: the worker takes its pieces in one by one
(Worker._intake), and the verdict settles every job still waiting, so a second piece's
begin before the first's verdict is a fault, raised as one (two pieces once shared these
sets, and the first verdict stopped the other's jobs).

Every job the engine starts ends with exactly one end output (JobEnded or JobErrored,
a cancel's included), and reports arrive in order, so a refused job's output is dropped
up to and including its end, and output of the same id after that is a later start's.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable

from exlq.worker.engine_loop import EngineRunner, StepReport
from exlq.worker.engines.base import EngineOutput, TokenChunk


class EarlyStarts:
    """The jobs started ahead of their verdict, and those refused whose output is dropped."""

    def __init__(self) -> None:
        self.waiting: set[str] = set()  # started, the script's verdict not yet taken in
        self.dropping: set[str] = set()  # refused while running: output dropped to its end
        self.begun_at = 0.0  # when the engine was told to start the waiting ones (Unix s)
        self._settled = asyncio.Event()
        self._settled.set()

    def begin(self, job_ids: Iterable[str], now: float) -> None:
        """The engine was told to start these ahead of their verdict, at ``now``."""
        if self.waiting:
            raise RuntimeError("a piece's early starts began while another's wait for a verdict")
        self.waiting.update(job_ids)
        self.begun_at = now
        if self.waiting:
            self._settled.clear()

    def started_at(self, job_id: str, now: float) -> float:
        """When the engine was told to start ``job_id``: early, or ``now``."""
        return self.begun_at if job_id in self.waiting else now

    def settle(self, runs: set[str], engine: EngineRunner) -> list[str]:
        """The verdict is in, and the jobs in ``runs`` are held: stop the others started
        early. Returns the ids stopped."""
        refused = [job_id for job_id in self.waiting if job_id not in runs]
        self._stop(refused, engine)
        return refused

    def abandon(self, engine: EngineRunner) -> None:
        """No verdict (the script failed, or the worker stops): stop every job started
        early; their entries stay pending in Redis for a reclaim."""
        self._stop(list(self.waiting), engine)

    def _stop(self, job_ids: list[str], engine: EngineRunner) -> None:
        for job_id in job_ids:
            self.dropping.add(job_id)
            engine.cancel(job_id)
        self.waiting.clear()
        self._settled.set()

    async def verdicts_for(self, reports: list[StepReport]) -> None:
        """Wait until no output of ``reports`` belongs to a job whose verdict is due."""
        while self.waiting and any(
            output.job_id in self.waiting for report in reports for output in report.outputs
        ):
            await self._settled.wait()

    def drops(self, output: EngineOutput) -> bool:
        """Whether ``output`` is of a job refused while running (and so dropped)."""
        if output.job_id not in self.dropping:
            return False
        if not isinstance(output, TokenChunk):  # its end: later output is a new start's
            self.dropping.discard(output.job_id)
        return True

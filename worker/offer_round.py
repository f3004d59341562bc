"""OfferRound: one piece's jobs offered to the engine before Redis says they start.

The start script (broker.start_jobs) decides which of a piece's jobs this worker runs: a
duplicate, an ended or a cancelled job does not. Without offers the engine hears of the
piece only after that round trip, and then checks and builds every job before its first
step. With --offer-before-start the worker offers the jobs in parts as it parses them: the
engine checks and builds the first part while the worker parses the rest and waits for the
script. The verdict then goes over as one admit, which names each offered job by id and
drops the offers the script refused. With --admit-before-start the offered jobs are
admitted once the last part is out, before the verdict (admit_early; the worker stops the
ones the script then refuses, worker/early_starts.py), and the admit after the script
brings only what was not started early.
"""

from __future__ import annotations

from exlq.protocol.models import GenerationRequest
from exlq.worker.engine_loop import EngineRunner

# A piece's first job is offered alone, the rest in parts of OFFER_PART: the engine, idle
# when a burst comes, starts on the first job while the worker parses the next eight, and
# a 32-job piece goes in 5 pipe messages (1, 8, 8, 8, 7). Its work a job (unpickling,
# checks, build) is longer than the worker's (parse), so the sooner it starts, the sooner
# its first step. Parts that doubled (1, 2, 4, 8, ...) measured slower at 32 jobs: each
# part's arrival takes the engine process's interpreter from its builds
# (docs/PERFORMANCE.md, "Jobs offered before their start").
FIRST_OFFER_PART = 1
OFFER_PART = 8


class OfferRound:
    """The offers of one piece, in order; ends with admit() or withdraw()."""

    def __init__(self, engine: EngineRunner, round_id: int) -> None:
        self.engine = engine
        self.round_id = round_id
        self.offered: dict[str, GenerationRequest] = {}
        self._part: list[tuple[str, GenerationRequest]] = []  # offered, not yet sent
        self.admitted_early: set[str] = set()

    def offer(self, request: GenerationRequest) -> None:
        """Offer a parsed request. An id offered before in this round is not offered again:
        an admit names an offered job by id, so each id stands for one request."""
        if request.id in self.offered:
            return
        self.offered[request.id] = request
        self._part.append((request.id, request))
        if len(self._part) >= (OFFER_PART if self._sent else FIRST_OFFER_PART):
            self.flush()

    @property
    def _sent(self) -> bool:
        """Whether a part went out: the engine then holds offers of this round."""
        return len(self.offered) > len(self._part)

    def flush(self) -> None:
        """Send the part offered so far."""
        if self._part:
            self.engine.offer(self.round_id, self._part)
            self._part = []

    def admit_early(self, now: float) -> list[str]:
        """Start every job offered, in order, before the start script's verdict; a job whose
        deadline has passed is left to the script (it ends as expired). Returns the ids
        started. The round's offers are used up: later admits bring their requests whole."""
        self.flush()
        started = [
            job_id for job_id, request in self.offered.items() if not request.past_deadline(now)
        ]
        if started or self._sent:
            self.engine.admit(self.round_id, [(job_id, None) for job_id in started])
        self.admitted_early.update(started)
        self.offered.clear()
        return started

    def admit(self, jobs: list[tuple[str, GenerationRequest]]) -> None:
        """Start these jobs, in order; a job offered in this round goes by id alone, and
        one started early is not started again."""
        self.flush()
        named = [
            (job_id, None if self.offered.get(job_id) is request else request)
            for job_id, request in jobs
            if job_id not in self.admitted_early
        ]
        if named or self._sent:
            self.engine.admit(self.round_id, named)

    def withdraw(self) -> None:
        """Start none of them (the start script failed: the entries stay pending in Redis).
        Jobs started early are the worker's to stop."""
        if self._sent:
            self.engine.admit(self.round_id, [])
        self._part = []  # never sent

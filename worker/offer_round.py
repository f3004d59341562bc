"""OfferRound: one piece's jobs offered to the engine before Redis says they start.

The start script (broker.start_jobs) decides which of a piece's jobs this worker runs: a
duplicate, an ended or a cancelled job does not. Without offers the engine hears of the
piece only after that round trip, and then checks and builds every job before its first
step. With --offer-before-start the worker offers the jobs in parts as it parses them: the
engine checks and builds the first part while the worker parses the rest and waits for the
script. The verdict then goes over as one admit, which names each offered job by id and
drops the offers the script refused.
"""

from __future__ import annotations

from producer.protocol import GenerationRequest
from worker.engine_loop import EngineRunner

# The parts grow from FIRST_OFFER_PART, doubling, up to OFFER_PART jobs: the engine starts
# on a piece's first job while the worker parses the second, and a 32-job piece still goes
# in 7 pipe messages (1, 2, 4, 8, 8, 8 and the last 1), not 32. The engine is idle when a
# burst comes, and its work a job (checks, build) is longer than the worker's (parse): the
# sooner it starts, the sooner its first step.
FIRST_OFFER_PART = 1
OFFER_PART = 8


class OfferRound:
    """The offers of one piece, in order; ends with admit() or withdraw(). Not ``enabled``:
    offers nothing, and admit() hands the jobs over whole, as add_many()."""

    def __init__(self, engine: EngineRunner, round_id: int, enabled: bool = True) -> None:
        self.engine = engine
        self.round_id = round_id
        self.enabled = enabled
        self.offered: dict[str, GenerationRequest] = {}
        self._part: list[tuple[str, GenerationRequest]] = []
        self._part_size = FIRST_OFFER_PART
        self._sent = False  # the engine holds offers of this round

    def offer(self, request: GenerationRequest) -> None:
        """Offer a parsed request. An id offered before in this round is not offered again:
        an admit names an offered job by id, so each id stands for one request."""
        if not self.enabled or request.id in self.offered:
            return
        self.offered[request.id] = request
        self._part.append((request.id, request))
        if len(self._part) >= self._part_size:
            self.flush()

    def flush(self) -> None:
        """Send the part offered so far; the next part may be twice as long."""
        if self._part:
            self.engine.offer(self.round_id, self._part)
            self._part = []
            self._part_size = min(2 * self._part_size, OFFER_PART)
            self._sent = True

    def admit(self, jobs: list[tuple[str, GenerationRequest]]) -> None:
        """Start these jobs, in order; a job offered in this round goes by id alone."""
        if not self.enabled:
            self.engine.add_many(jobs)
            return
        self.flush()
        named = [
            (job_id, None if self.offered.get(job_id) is request else request)
            for job_id, request in jobs
        ]
        if named or self._sent:
            self.engine.admit(self.round_id, named)

    def withdraw(self) -> None:
        """Start none of them (the start script failed: the entries stay pending in Redis)."""
        self._part = []
        if self._sent:
            self.engine.admit(self.round_id, [])

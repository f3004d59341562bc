"""OfferRound: the engine's side of one piece: its jobs offered in parts before Redis says
they start, then started in one admit.

The start script (broker.start_jobs) decides which of a piece's jobs this worker runs: a
duplicate, an ended or a cancelled job does not. Without offers the engine hears of the
piece only after that round trip, and then checks and builds every job before its first
step. So the worker offers the jobs in parts as it parses them: the engine checks and
builds the first part while the worker parses the rest. Once the last part is out, one
admit starts them (start), before the script's verdict: the worker stops the ones it then
refuses (job_state.Piece). The admit names each offered job by id, so a request crosses
the pipe once, and ends the round in the engine. Which job is where is job_state's to
know; this only sends a round's messages.
"""

from __future__ import annotations

from exlq.worker.engine_loop import EngineRunner
from exlq.worker.engines.engine_request import EngineRequest

# A piece's first job is offered alone, the rest in parts of OFFER_PART: the engine, idle
# when a burst comes, starts on the first job while the worker parses the next eight, and
# a 32-job piece goes in 5 pipe messages (1, 8, 8, 8, 7). Its work a job (unpickling,
# checks, build) is longer than the worker's (parse), so the sooner it starts, the sooner
# its first step. Parts that doubled (1, 2, 4, 8, ...) started the first step later: each
# part's arrival takes the engine process's interpreter from its builds
# (docs/PERFORMANCE.md, "Starting a burst (always on)").
FIRST_OFFER_PART = 1
OFFER_PART = 8


class OfferRound:
    """The offers of one piece, in order, then its admits; ends with start() or withdraw().
    Each job id is offered once a round (the caller sees to it)."""

    def __init__(self, engine: EngineRunner, round_id: int) -> None:
        self.engine = engine
        self.round_id = round_id
        self._part: list[tuple[str, EngineRequest]] = []  # offered, not yet sent
        self._sent = False  # a part went out: the engine holds offers of this round
        self._open = True  # no admit has ended the round in the engine

    def offer(self, job_id: str, request: EngineRequest) -> None:
        self._part.append((job_id, request))
        if len(self._part) >= (OFFER_PART if self._sent else FIRST_OFFER_PART):
            self.flush()

    def flush(self) -> None:
        """Send the part offered so far."""
        if self._part:
            self.engine.offer(self.round_id, self._part)
            self._part = []
            self._sent = True

    def start(self, job_ids: list[str]) -> None:
        """Start these offered jobs in one pass, by id, and drop the round's other offers."""
        self.flush()
        if job_ids or self._sent:
            self.engine.admit(self.round_id, [(job_id, None) for job_id in job_ids])
        self._open = False

    def start_whole(self, jobs: list[tuple[str, EngineRequest]]) -> None:
        """Start these jobs in one pass, their requests given whole: after start(), or in
        place of it."""
        if self._open:
            self.flush()
            self._open = False
            if not (jobs or self._sent):
                return
        elif not jobs:
            return
        self.engine.admit(self.round_id, jobs)

    def withdraw(self) -> None:
        """Start none of the jobs offered (no verdict: their entries stay pending in Redis).
        Jobs started already are the caller's to stop."""
        if self._open and self._sent:
            self.engine.admit(self.round_id, [])
        self._part = []  # never sent
        self._open = False

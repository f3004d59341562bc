"""What tests of the engine loop read from its reports."""

from __future__ import annotations

import queue

from exlq.worker.engine_loop import StepReport
from exlq.worker.engines.base import EngineOutput


def collect_ends(reports: queue.SimpleQueue[StepReport], want: int) -> list[EngineOutput]:
    """The next ``want`` job ends (or errors) the loop reports; no report may be fatal."""
    ended: list[EngineOutput] = []
    while len(ended) < want:
        report = reports.get(timeout=5)
        assert report.fatal is None
        ended += [o for o in report.outputs if not hasattr(o, "text")]
    return ended

"""bench.baselines._StepLog: what the engine alone's timed loop records of each iterate()."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from bench.baselines import _StepLog


def _streaming(job: int, new_tokens: int, handed: int | None) -> dict[str, Any]:
    """One of exllamav2's streaming results: ``handed`` tokens handed to the caller (None
    where the generator held them back with their text)."""
    result: dict[str, Any] = {
        "stage": "streaming",
        "identifier": job,
        "job": SimpleNamespace(new_tokens=new_tokens),
        "eos": False,
    }
    if handed is not None:
        result["token_ids"] = SimpleNamespace(shape=(1, handed))
    return result


def test_a_jobs_first_event_counts_the_tokens_it_hands_over_held_back_ones_included() -> None:
    log = _StepLog(2)
    log.record([_streaming(0, 1, 1), _streaming(1, 1, None)], 0.0, 0.010)  # job 1 held back
    log.record([_streaming(0, 2, 1), _streaming(1, 2, None)], 0.010, 0.020)
    log.record([_streaming(0, 3, 1), _streaming(1, 3, 3)], 0.020, 0.030)  # all three at once
    log.record([_streaming(0, 4, 1), _streaming(1, 4, 1)], 0.030, 0.040)
    assert log.first_event_tokens == [1, 3]
    assert log.event_times == [[0.010, 0.020, 0.030, 0.040], [0.030, 0.040]]
    # Made, each token is timed in its own step, held back or not.
    assert log.token_times[1] == [0.010, 0.020, 0.030, 0.040]

"""A job's end as exllamav2's and exllamav3's generators report it."""

from __future__ import annotations

from exlq.worker.engines.base import JobEnded
from exlq.worker.engines.exllama_results import ended_job


def test_the_reason_and_the_counts_come_from_the_result() -> None:
    result = {
        "eos": True,
        "eos_reason": "max_new_tokens",
        "prompt_tokens": 12,
        "new_tokens": 5,
        "cached_tokens": 8,
    }
    assert ended_job("a", result, 99) == JobEnded("a", "length", 12, 5, 8)
    for reason in ("stop_token", "stop_string", "end_filter", "loop_detected"):
        assert ended_job("a", {**result, "eos_reason": reason}, 99).finish_reason == "stop"


def test_the_engine_fills_what_the_result_leaves_out_and_drafting_counts_pass_through() -> None:
    ended = ended_job("b", {"eos": True}, 7, draft_tokens=4, accepted_draft_tokens=3)
    assert ended == JobEnded("b", "stop", 7, 0, 0, 4, 3)

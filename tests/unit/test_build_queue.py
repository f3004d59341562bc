"""The engine builds accepted jobs only when a step could start them, in arrival order."""

from __future__ import annotations

from exlq.worker.engines.exllamav2.build_queue import BuildQueue
from exlq.worker.engines.exllamav2.prefill_plan import jobs_to_start


def _queue(prompts: list[int]) -> BuildQueue[int]:
    queue: BuildQueue[int] = BuildQueue()
    for n, tokens in enumerate(prompts):
        queue.put(f"j{n}", tokens, n)
    return queue


def test_a_burst_is_built_one_job_past_the_slice_the_step_starts() -> None:
    queue = _queue([256] * 128)
    built = [a.job_id for a in queue.take(waiting_tokens=0, budget_tokens=8192)]
    assert built == [f"j{n}" for n in range(33)]
    # The step offers the same 32 jobs as if all 128 had been built.
    assert jobs_to_start([256] * len(built), 8192) == jobs_to_start([256] * 128, 8192) == 32
    assert len(queue) == 95


def test_jobs_built_and_still_waiting_count_against_the_budget() -> None:
    queue = _queue([256] * 40)
    assert [a.job_id for a in queue.take(waiting_tokens=256, budget_tokens=8192)] == [
        f"j{n}" for n in range(32)
    ]
    assert list(queue.take(waiting_tokens=8193, budget_tokens=8192)) == []
    assert len(queue) == 8


def test_a_prompt_longer_than_the_budget_is_still_built() -> None:
    queue = _queue([10_000, 100])
    assert [a.prompt_tokens for a in queue.take(waiting_tokens=0, budget_tokens=4096)] == [10_000]
    assert [a.prompt_tokens for a in queue.take(waiting_tokens=0, budget_tokens=4096)] == [100]


def test_without_a_budget_every_job_is_built_at_once() -> None:
    queue = _queue([256] * 128)
    assert [a.item for a in queue.take(waiting_tokens=10**6, budget_tokens=0)] == list(range(128))
    assert len(queue) == 0


def test_cancel_and_clear_leave_the_rest_in_order() -> None:
    queue = _queue([300] * 6)
    removed = queue.remove("j1")
    assert removed is not None and removed.item == 1 and "j1" not in queue
    assert queue.remove("j1") is None
    assert [a.job_id for a in queue.take(waiting_tokens=0, budget_tokens=1000)] == [
        "j0",
        "j2",
        "j3",
        "j4",
    ]
    assert queue.clear() == ["j5"] and len(queue) == 0


def test_a_caller_that_stops_early_leaves_the_rest_queued() -> None:
    queue = _queue([10] * 5)
    taken = queue.take(waiting_tokens=0, budget_tokens=0)
    assert next(taken).job_id == "j0"
    assert len(queue) == 4 and "j1" in queue

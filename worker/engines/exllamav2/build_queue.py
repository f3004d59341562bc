"""BuildQueue: jobs the engine has accepted but not yet built into the generator's jobs.
Plain Python: no torch, no exllamav2.

Building an exllamav2 job is its own Python, so a large burst's builds, one after another,
take longer than a decode step. The admission budget starts a burst in slices (prefill_plan.
jobs_to_start), yet a job built on arrival is built before the step that starts the first
slice, and that slice's first tokens wait for every build. The engine checks a request when
it arrives (its errors stay synchronous) and builds it only when the next step could start
it: take() hands over, in order, the jobs that bring the generator's waiting prompt tokens
past the budget, one past it, so the step offers the same slice as if every job had been
built on arrival.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Accepted(Generic[T]):
    job_id: str
    prompt_tokens: int
    item: T


def room_for_one_more(waiting_tokens: int, budget_tokens: int) -> bool:
    """Whether a step could start one more job, its waiting jobs holding ``waiting_tokens``
    of prompt: while they hold no more than the admission budget (0: no budget)."""
    return not budget_tokens or waiting_tokens <= budget_tokens


class BuildQueue(Generic[T]):
    """Accepted jobs in arrival order, until the engine builds them."""

    def __init__(self) -> None:
        self._waiting: OrderedDict[str, Accepted[T]] = OrderedDict()

    def put(self, job_id: str, prompt_tokens: int, item: T) -> None:
        self._waiting[job_id] = Accepted(job_id, prompt_tokens, item)

    def take(self, waiting_tokens: int, budget_tokens: int) -> Iterator[Accepted[T]]:
        """The jobs to build before a step, in order, given ``waiting_tokens`` of prompt
        held by the jobs already built and waiting to start: while those hold no more than
        the admission budget, one more. Budget 0: every job. Taken lazily, so a caller that
        stops early leaves the rest queued."""
        while self._waiting and room_for_one_more(waiting_tokens, budget_tokens):
            _, accepted = self._waiting.popitem(last=False)
            waiting_tokens += accepted.prompt_tokens
            yield accepted

    def remove(self, job_id: str) -> Accepted[T] | None:
        return self._waiting.pop(job_id, None)

    def clear(self) -> list[str]:
        ids = list(self._waiting)
        self._waiting.clear()
        return ids

    def __len__(self) -> int:
        return len(self._waiting)

    def __contains__(self, job_id: object) -> bool:
        return job_id in self._waiting

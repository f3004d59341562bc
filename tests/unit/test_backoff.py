"""The Redis backoff: 0.1 s doubling to 5 s, plus jitter, on any tenacity 8.x or 9.x."""

from __future__ import annotations

import pytest
from tenacity import AsyncRetrying, RetryCallState, retry_if_exception_type, stop_after_attempt

from exlq.protocol.backoff import REDIS_BACKOFF


def _state(attempt: int) -> RetryCallState:
    state = RetryCallState(retry_object=AsyncRetrying(), fn=None, args=(), kwargs={})
    state.attempt_number = attempt
    return state


@pytest.mark.parametrize(("attempt", "low", "high"), [(1, 0.1, 1.1), (3, 0.4, 1.4), (9, 5.0, 5.0)])
def test_waits_grow_from_a_tenth_of_a_second_to_five(attempt: int, low: float, high: float) -> None:
    waits = [REDIS_BACKOFF(_state(attempt)) for _ in range(50)]
    assert all(low <= wait <= high for wait in waits)


async def test_a_retry_loop_takes_it_as_its_wait() -> None:
    # tenacity 8 hands the wait its state by keyword, 9 by position.
    slept: list[float] = []

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    tries = 0
    async for attempt in AsyncRetrying(
        retry=retry_if_exception_type(OSError),
        wait=REDIS_BACKOFF,
        stop=stop_after_attempt(3),
        sleep=sleep,
    ):
        with attempt:
            tries += 1
            if tries < 3:
                raise OSError("away")
    assert tries == 3
    assert len(slept) == 2 and 0.1 <= slept[0] <= 1.1

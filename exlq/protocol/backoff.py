"""How long exlq waits between tries while Redis is away: one policy, SDK and workers alike."""

from __future__ import annotations

import random

from tenacity import RetryCallState

_FIRST_WAIT_S = 0.1
_MAX_WAIT_S = 5.0
_JITTER_S = 1.0


def _redis_backoff_s(retry_state: RetryCallState) -> float:
    # Named retry_state: tenacity 8 passes it by keyword.
    return min(
        _FIRST_WAIT_S * 2.0 ** (retry_state.attempt_number - 1) + random.uniform(0, _JITTER_S),
        _MAX_WAIT_S,
    )


# For tenacity retry loops: 0.1 s growing to 5 s, with jitter so clients do not stampede.
# Written out rather than tenacity's wait_exponential_jitter, whose keyword for the first
# wait changed in 9.2 (`initial`, which now warns, became `multiplier`, unknown before):
# the SDK installs beside whatever tenacity 8.x or 9.x an application has.
REDIS_BACKOFF = _redis_backoff_s

_DELAYS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


def reconnect_delay_s(failures: int) -> float:
    """For loops that run for good and start over after each success."""
    return _DELAYS_S[min(failures, len(_DELAYS_S) - 1)]

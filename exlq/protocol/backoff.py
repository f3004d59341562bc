"""How long exlq waits between tries while Redis is away: one policy, SDK and workers alike."""

from __future__ import annotations

from tenacity import wait_exponential_jitter

# For tenacity retry loops: 0.1 s growing to 5 s, with jitter so clients do not stampede.
REDIS_BACKOFF = wait_exponential_jitter(multiplier=0.1, max=5.0)

_DELAYS_S = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0)


def reconnect_delay_s(failures: int) -> float:
    """For loops that run for good and start over after each success."""
    return _DELAYS_S[min(failures, len(_DELAYS_S) - 1)]

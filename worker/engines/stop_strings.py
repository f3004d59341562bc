"""Where a text meets a job's stop strings: shared by engines that find them themselves."""

from __future__ import annotations

from collections.abc import Sequence


def first_stop(stops: Sequence[str], text: str) -> int | None:
    """Where the first stop string in ``text`` begins, or None."""
    positions = [at for at in (text.find(stop) for stop in stops) if at >= 0]
    return min(positions) if positions else None


def held_back(stops: Sequence[str], text: str) -> int:
    """Length of the longest tail of ``text`` that begins some stop string: text an engine
    holds back, since the next token may complete the stop string."""
    longest = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), longest, -1):
            if text.endswith(stop[:size]):
                longest = size
                break
    return longest

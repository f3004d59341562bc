"""QuietWait: a job's next event from its queue, or None once the queue has been quiet for
a while, watched by one timer per queue rather than one per wait.

A stream waits for its next event after nearly every event. An ``asyncio.timeout`` around
each wait put a timer in the event loop's heap for each event, cancelled when the event
came: with a burst's streams, pushing and cancelling those timers was a large share of
the SDK's work per event (docs/PERFORMANCE.md, "The way back, and Redis (always on)").
Here one timer runs per queue while its stream waits. When it fires, a wait older than the
quiet period is ended by a marker put in the queue; a newer one moves the timer to its own
deadline.
"""

from __future__ import annotations

import asyncio

# Ends a quiet wait. Events are JSON objects: none is these bytes.
_QUIET = b"\x00quiet"


class QuietWait:
    def __init__(self, events: asyncio.Queue[bytes]) -> None:
        self._events = events
        self._due: float | None = None  # the loop's time the current wait ends, if one waits
        self._timer: asyncio.TimerHandle | None = None

    async def next(self, quiet_s: float) -> bytes | None:
        """The queue's next item; None when none came within ``quiet_s``."""
        if not self._events.empty():
            raw = self._events.get_nowait()
        else:
            loop = asyncio.get_running_loop()
            self._due = loop.time() + quiet_s
            if self._timer is None:
                self._timer = loop.call_at(self._due, self._check)
            try:
                raw = await self._events.get()
            finally:
                self._due = None
        return None if raw == _QUIET else raw

    def close(self) -> None:
        """Stop the timer (the stream has ended)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _check(self) -> None:
        self._timer = None
        due = self._due
        if due is None:
            return  # not waiting: the next wait sets the timer again
        loop = asyncio.get_running_loop()
        if loop.time() < due:
            self._timer = loop.call_at(due, self._check)
        elif self._events.empty():  # else an event is on its way to the waiter
            self._events.put_nowait(_QUIET)

"""When Python's cyclic garbage collector may pause the worker's processes.

CPython's collector stops every thread of its process while it runs, and it runs when
enough objects have been made since the last collection, wherever that happens to be.
Traced (`bench.path_trace`, docs/PERFORMANCE.md, "Starting a burst (always on)"), the
worker's event loop ran a full collection (generation 2), longer than a decode step, in
8-job bursts, and the engine process young collections on the way to the first step of
32-job bursts: building a burst's jobs allocates thousands of objects at once.

Three measures, one for each place:

- ``freeze_startup_heap()``: once a process has loaded (exllamav2, torch and the model in
  the engine process; pydantic's schemas, redis-py and prometheus_client in both),
  ``gc.collect()`` then ``gc.freeze()`` move every object alive into the permanent
  generation, which no collection walks: a full collection then walks only what serving
  made since. vLLM's engine core and SGLang freeze their start-up heap the same way.
- ``HeldCollections`` (the engine loop's thread): when commands reach an idle engine (a
  burst begins), automatic collections are held off until the engine's first wait for
  the GPU in a decode step, where the young collection that fell due runs in the GPU's
  shadow and CPython takes collecting back. The burst's jobs are checked, built, admitted
  and prefilled, and their first report sent, without a pause.
- ``collections_deferred()`` (the worker's event loop): a piece is taken in (its reads,
  parse, offers, the start script and the hand-over) with automatic collections held
  off; the young collection that fell due runs at its end, while the engine prefills.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)


def freeze_startup_heap() -> int:
    """Collect, then move every object alive into the permanent generation; returns how
    many the permanent generation holds."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("start-up heap frozen: %d objects out of the collector's reach", frozen)
    return frozen


def due_generation() -> int | None:
    """The generation CPython would collect now, were its automatic collections on, its
    full collections aside (CPython runs those only once the objects promoted since the
    last exceed a quarter of the oldest generation, which Python does not expose); None
    when none is due, or its thresholds turn collections off (a first threshold of 0)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if not thresholds[0]:
        return None
    for generation in (1, 0):
        if counts[generation] > thresholds[generation]:
            return generation
    return None


class HeldCollections:
    """Automatic collections held off from ``hold()`` to ``release()``, for a stretch of
    one thread that must not pause. ``release()`` first runs the young collection that fell
    due meanwhile (generation 0 or 1), then gives collecting back to CPython, whose own
    policy (full collections included) goes on as before."""

    def __init__(self) -> None:
        self._was_enabled = False
        self.held = False
        self.steps = 0  # steps run since the hold began
        self.collections = 0  # young collections run by release(), for tests and logs

    def hold(self) -> None:
        """Hold collections off; a hold already on starts its count of steps again."""
        self.steps = 0
        if not self.held:
            self._was_enabled = gc.isenabled()
            gc.disable()
            self.held = True

    def step_ran(self, most: int) -> None:
        """A step ran while held: after ``most`` of them, release."""
        if self.held:
            self.steps += 1
            if self.steps >= most:
                self.release()

    def release(self) -> None:
        if not self.held:
            return
        generation = due_generation()
        if generation is not None:
            gc.collect(generation)
            self.collections += 1
        if self._was_enabled:
            gc.enable()
        self.held = False


@contextlib.contextmanager
def collections_deferred() -> Iterator[None]:
    """No automatic collection inside; after, the young collection that fell due runs and
    the state before (on or off) comes back (HeldCollections around the block)."""
    held = HeldCollections()
    held.hold()
    try:
        yield
    finally:
        held.release()

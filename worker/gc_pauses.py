"""When Python's cyclic garbage collector may pause the worker's processes.

CPython's collector stops every thread of its process while it runs, and it runs when
enough objects have been made since the last collection, wherever that happens to be.
Traced on the H100's host (`bench.path_trace`, 1B, docs/PERFORMANCE.md, "Python's
collector off the way in"): the worker's processes ran a full collection (generation 2)
of 20-32 ms during one 8-job burst of every trace, and a generation-1 collection of about
2 ms on the way to the first step in one 32-job burst of three: the worker parsing the
burst and the engine building its jobs allocate thousands of objects in a few ms.

Three measures, one for each place:

- ``freeze_startup_heap()``: once a process has loaded (exllamav2, torch and the model in
  the engine process; pydantic's schemas, redis-py and prometheus_client in both),
  ``gc.collect()`` then ``gc.freeze()`` move every object alive into the permanent
  generation, which no collection walks: a full collection then walks only what serving
  made since. vLLM's engine core and SGLang freeze their start-up heap the same way.
- ``ShadowCollector`` (the engine loop's thread): automatic collections are off while the
  loop runs, and the loop runs what CPython would have run at the points where the
  engine waits anyway: while the GPU runs a decode step (its wait work), when the engine
  has nothing to do, and after a step once a collection is far overdue. A burst's jobs
  are then built, admitted and prefilled, and their first report sent, without a pause.
- ``collections_deferred()`` (the worker's event loop): a piece is taken in (its reads,
  parse, offers, the start script and the hand-over) with automatic collections held
  off; what falls due runs at the first allocation after, while the engine steps.
"""

from __future__ import annotations

import contextlib
import gc
import logging
from collections.abc import Iterator

log = logging.getLogger(__name__)

# After a step, collect anyway once the youngest generation holds this many times its
# threshold (CPython's default 700: about 11,000 objects): a run of steps without a
# decode wait (prefills) must not let the young generations grow without bound.
OVERDUE_FACTOR = 16


def freeze_startup_heap() -> int:
    """Collect, then move every object alive into the permanent generation; returns how
    many the permanent generation holds."""
    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    log.debug("start-up heap frozen: %d objects out of the collector's reach", frozen)
    return frozen


@contextlib.contextmanager
def collections_deferred() -> Iterator[None]:
    """No automatic collection inside; the state before (on or off) comes back after."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def due_generation() -> int | None:
    """The generation CPython would collect now, were its automatic collections on; None
    when none is due (or its thresholds turn them off: a first threshold of 0)."""
    counts, thresholds = gc.get_count(), gc.get_threshold()
    if not thresholds[0]:
        return None
    for generation in (2, 1, 0):
        if counts[generation] > thresholds[generation]:
            return generation
    return None


class ShadowCollector:
    """Collections at chosen points of one thread, none automatic in between.

    ``start()`` turns automatic collections off, ``stop()`` puts back what was there;
    ``collect_if_due()`` runs what CPython would run now, ``collect_if_overdue()`` only
    when the youngest generation is OVERDUE_FACTOR times past its threshold."""

    def __init__(self) -> None:
        self._was_enabled = False
        self.collections = 0  # run here, for tests and logs

    def start(self) -> None:
        self._was_enabled = gc.isenabled()
        gc.disable()

    def stop(self) -> None:
        if self._was_enabled:
            gc.enable()

    def collect_if_due(self) -> int | None:
        """Collect the generation due, if any; returns it."""
        generation = due_generation()
        if generation is not None:
            gc.collect(generation)
            self.collections += 1
        return generation

    def collect_if_overdue(self) -> int | None:
        threshold = gc.get_threshold()[0]
        if threshold and gc.get_count()[0] > OVERDUE_FACTOR * threshold:
            return self.collect_if_due()
        return None

"""Where Python's collector may pause the worker: never while the engine takes a job in,
and the start-up heap out of its reach."""

from __future__ import annotations

import gc
import queue
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from producer.protocol import GenerationRequest
from tests.engine_reports import collect_ends
from worker.engine_loop import EngineLoop, StepReport
from worker.engines.base import JobEnded
from worker.engines.echo import EchoEngine
from worker.gc_pauses import (
    OVERDUE_FACTOR,
    ShadowCollector,
    collections_deferred,
    due_generation,
    freeze_startup_heap,
)


class _Node:
    """A container that can hold a reference to itself: cyclic garbage."""

    def __init__(self) -> None:
        self.other: object = None


def _cycles(count: int) -> list[weakref.ref[_Node]]:
    """Make ``count`` unreachable cycles, only the collector can free; weak refs to them."""
    refs = []
    for _ in range(count):
        node = _Node()
        node.other = node
        refs.append(weakref.ref(node))
    return refs


@pytest.fixture
def collector_state() -> Iterator[None]:
    """Low thresholds (collections every 50 objects), and the collector as it was after."""
    enabled, thresholds = gc.isenabled(), gc.get_threshold()
    gc.collect()
    gc.set_threshold(50, 2, 2)
    try:
        yield
    finally:
        gc.set_threshold(*thresholds)
        gc.unfreeze()
        if enabled:
            gc.enable()
        else:
            gc.disable()


def test_the_start_up_heap_is_frozen_out_of_the_collectors_generations(
    collector_state: None,
) -> None:
    loaded = [[1, 2], {"model": "weights"}]
    assert any(o is loaded for o in gc.get_objects())
    assert freeze_startup_heap() == gc.get_freeze_count() > 0
    assert not any(o is loaded for o in gc.get_objects())


def test_no_automatic_collection_while_deferred_and_the_state_before_comes_back(
    collector_state: None,
) -> None:
    gc.enable()
    with collections_deferred():
        assert not gc.isenabled()
        refs = _cycles(500)  # ten times the threshold
        assert all(r() is not None for r in refs)
    assert gc.isenabled()
    with pytest.raises(RuntimeError), collections_deferred():
        raise RuntimeError("a failed start script")
    assert gc.isenabled()
    gc.disable()  # a user who turned the collector off keeps it off
    with collections_deferred():
        pass
    assert not gc.isenabled()


def test_the_shadow_collector_collects_only_when_asked_and_what_cpython_would(
    collector_state: None,
) -> None:
    gc.enable()
    collector = ShadowCollector()
    collector.start()
    try:
        refs = _cycles(60)
        assert all(r() is not None for r in refs)  # past the threshold, not collected
        assert due_generation() is not None
        # Not yet OVERDUE_FACTOR times past it: an overdue check leaves it.
        assert collector.collect_if_overdue() is None
        assert collector.collect_if_due() is not None
        assert all(r() is None for r in refs)
        assert due_generation() is None and collector.collect_if_due() is None
        _cycles(OVERDUE_FACTOR * 50 + 10)
        assert collector.collect_if_overdue() is not None
        assert collector.collections == 2
    finally:
        collector.stop()
    assert gc.isenabled()


class _BuildingEngine(EchoEngine):
    """Echo whose intake makes cyclic garbage, as building an exllamav2 job does."""

    def __init__(self) -> None:
        super().__init__(capacity=4, tokens_per_second=200)
        self.taking_in = False

    def add(self, job_id: str, request: GenerationRequest) -> None:
        self.taking_in = True
        try:
            _cycles(400)
            super().add(job_id, request)
        finally:
            self.taking_in = False


def test_the_engine_loop_collects_in_its_waits_and_never_while_taking_jobs_in(
    collector_state: None,
) -> None:
    gc.enable()
    engine = _BuildingEngine()
    seen: list[tuple[str, bool]] = []  # (thread, during intake) of each collection

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append((threading.current_thread().name, engine.taking_in))

    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(engine, collector=ShadowCollector())
    gc.callbacks.append(note)
    try:
        loop.start(reports.put)
        jobs = [(f"j{i}", GenerationRequest(prompt="x y", max_new_tokens=4)) for i in range(4)]
        loop.add_many(jobs)
        assert sorted(type(e).__name__ for e in collect_ends(reports, 4)) == ["JobEnded"] * 4
        loop.add_many(jobs[:1])  # after an idle engine's collection
        ended = collect_ends(reports, 1)
        assert ended == [JobEnded("j0", "length", 2, 4)]
        assert not gc.isenabled()  # while the loop runs
        loop.stop(5)
    finally:
        gc.callbacks.remove(note)
    assert gc.isenabled()
    assert seen and all(thread == "exlq-engine" for thread, _ in seen)
    assert not any(during for _, during in seen)
    assert loop.collector is not None and loop.collector.collections == len(seen)

"""Where Python's collector may pause the worker: never while the engine takes a job in,
and the start-up heap out of its reach."""

from __future__ import annotations

import gc
import queue
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest
from exlq.worker.engine_loop import HELD_STEPS_MAX, EngineLoop, StepReport
from exlq.worker.engines.base import EngineOutput, JobEnded
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.engines.engine_request import EngineRequest
from exlq.worker.gc_pauses import (
    HeldCollections,
    collections_deferred,
    due_generation,
    freeze_startup_heap,
)
from tests.engine_reports import collect_ends


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


def test_held_collections_run_the_young_collection_due_then_give_collecting_back(
    collector_state: None,
) -> None:
    gc.enable()
    held = HeldCollections()
    held.release()  # not held: nothing to do
    assert gc.isenabled() and held.collections == 0
    held.hold()
    assert not gc.isenabled() and held.held
    refs = _cycles(200)  # four times the threshold: collections are due, none runs
    assert all(r() is not None for r in refs)
    assert due_generation() in (0, 1)
    held.release()
    assert held.collections == 1 and all(r() is None for r in refs)
    assert gc.isenabled() and not held.held
    gc.disable()  # a user who turned the collector off keeps it off
    held.hold()
    held.release()
    assert not gc.isenabled()


class _BuildingEngine(EchoEngine):
    """Echo whose intake makes cyclic garbage, as building an exllamav2 job does."""

    def __init__(self) -> None:
        super().__init__(capacity=4, tokens_per_second=200)
        self.taking_in = False

    def add(self, job_id: str, request: EngineRequest) -> None:
        self.taking_in = True
        try:
            _cycles(400)
            super().add(job_id, request)
        finally:
            self.taking_in = False


def test_no_collection_pauses_a_burst_on_its_way_in_and_collecting_comes_back_after(
    collector_state: None,
) -> None:
    gc.enable()
    engine = _BuildingEngine()
    during_intake: list[bool] = []  # for each collection: did it start inside a job's intake?
    enabled_at_wait: list[bool] = []

    def note(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            during_intake.append(engine.taking_in)

    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    collections = HeldCollections()
    loop = EngineLoop(engine, collections=collections)
    real_in_wait = loop._in_wait

    def in_wait() -> None:
        enabled_at_wait.append(gc.isenabled())  # held until the first wait for the GPU
        real_in_wait()

    loop._in_wait = in_wait  # type: ignore[method-assign]
    gc.callbacks.append(note)
    try:
        loop.start(reports.put)
        jobs = [(f"j{i}", GenerationRequest(prompt="x y", max_new_tokens=4)) for i in range(4)]
        loop.add_many(jobs)
        assert sorted(type(e).__name__ for e in collect_ends(reports, 4)) == ["JobEnded"] * 4
        loop.add_many(jobs[:1])  # a second burst, after the engine was idle
        assert collect_ends(reports, 1) == [JobEnded("j0", "length", 2, 4)]
        loop.stop(5)
    finally:
        gc.callbacks.remove(note)
    assert gc.isenabled() and not collections.held
    # Each burst built its jobs (1,600 cyclic objects, 32 thresholds' worth) with none run.
    assert not any(during_intake)
    # The first wait of each burst found collections held, and gave them back.
    assert enabled_at_wait[0] is False and True in enabled_at_wait
    assert collections.collections >= 2 and len(during_intake) >= collections.collections


class _NeverWaitingEngine(EchoEngine):
    """Echo too fast to wait between steps, as a run of prefill steps never waits for the
    GPU: notes whether collections were on at each step."""

    def __init__(self) -> None:
        super().__init__(capacity=2, tokens_per_second=1e9)
        self.enabled_at_step: list[bool] = []

    def step(self) -> list[EngineOutput]:
        self.enabled_at_step.append(gc.isenabled())
        return super().step()


def test_collections_held_come_back_after_a_few_steps_that_never_wait(
    collector_state: None,
) -> None:
    gc.enable()
    engine = _NeverWaitingEngine()
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    loop = EngineLoop(engine, collections=HeldCollections())
    loop.start(reports.put)
    loop.add_many([("long", GenerationRequest(prompt="x", max_new_tokens=3 * HELD_STEPS_MAX))])
    assert collect_ends(reports, 1) == [JobEnded("long", "length", 1, 3 * HELD_STEPS_MAX)]
    loop.stop(5)
    held = engine.enabled_at_step[:HELD_STEPS_MAX]
    after = engine.enabled_at_step[HELD_STEPS_MAX:]
    assert held == [False] * HELD_STEPS_MAX and after and all(after)


def test_a_hold_gives_collecting_back_after_its_most_steps_counted_from_each_hold(
    collector_state: None,
) -> None:
    gc.enable()
    held = HeldCollections()
    held.step_ran(2)  # not held: nothing counts
    held.hold()
    held.step_ran(2)
    held.hold()  # a new burst on a hold still on: its count starts again
    held.step_ran(2)
    assert held.held and not gc.isenabled()
    held.step_ran(2)
    assert not held.held and gc.isenabled()

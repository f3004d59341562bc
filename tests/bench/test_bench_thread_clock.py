"""bench.thread_clock: per-thread CPU time, run-queue waits and preemptions from /proc."""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any

import pytest

from bench import thread_clock

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="reads /proc/PID/task (Linux)"
)


def _spin(seconds: float) -> None:
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        pass


def test_the_busiest_thread_is_the_one_that_ran_and_its_time_is_counted() -> None:
    idle = threading.Event()
    sleeper = threading.Thread(target=idle.wait, name="sleeper")
    sleeper.start()
    try:
        before = thread_clock.snapshot([os.getpid()])
        _spin(0.2)
        spent = thread_clock.diff(before, thread_clock.snapshot([os.getpid()]))
    finally:
        idle.set()
        sleeper.join()
    main = spent[(os.getpid(), threading.get_native_id())]
    assert thread_clock.busiest(spent) == main
    assert 0.2e9 <= main.run_ns < 1e9
    assert main.wait_ns >= 0 and main.preempted >= 0
    figures = thread_clock.stepper_figures(spent, steps=100)
    assert figures["stepper_run_us_per_step"] == pytest.approx(main.run_ns / 100 / 1000)
    # The sleeper and the rest together spent far less than the spinning thread.
    assert figures["others_run_us_per_step"] < figures["stepper_run_us_per_step"] / 4


def test_the_stepping_threads_cpu_is_the_one_it_was_held_on() -> None:
    cpu = sorted(os.sched_getaffinity(0))[-1]
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        start = thread_clock.snapshot([os.getpid()])
        _spin(0.05)
        spent = thread_clock.diff(start, thread_clock.snapshot([os.getpid()]))
    finally:
        os.sched_setaffinity(0, before)
    assert thread_clock.stepper_figures(spent, steps=10)["stepper_cpu"] == cpu


def test_a_process_that_is_gone_or_no_steps_gives_nothing() -> None:
    assert thread_clock.snapshot([2**22 + 12345]) == {}  # above Linux's largest pid
    assert thread_clock.stepper_figures({}, steps=0) == {}
    assert thread_clock.busiest({}).run_ns == 0


def _signal_then_wait(ready: Any, stop: Any) -> None:
    ready.set()
    stop.wait()


def test_the_spawned_child_is_found_and_the_resource_tracker_is_not() -> None:
    import multiprocessing

    context = multiprocessing.get_context("spawn")
    ready, stop = context.Event(), context.Event()
    child = context.Process(target=_signal_then_wait, args=(ready, stop))
    child.start()
    # Until the child has exec'd Python its cmdline is still this process's: wait for it to
    # run its target, as the worker's engine process has long done when the bench looks.
    assert ready.wait(30)
    try:
        # Event() started a resource tracker too: a child of this process as well.
        assert thread_clock.spawned_child(os.getpid()) == child.pid
    finally:
        stop.set()
        child.join()


def test_the_busiest_threads_id_is_found_and_it_can_be_pinned_alone() -> None:
    idle = threading.Event()
    sleeper = threading.Thread(target=idle.wait, name="sleeper")
    sleeper.start()
    pid, main = os.getpid(), threading.get_native_id()
    before = os.sched_getaffinity(0)
    try:
        start = thread_clock.snapshot([pid])
        _spin(0.05)
        spent = thread_clock.diff(start, thread_clock.snapshot([pid]))
        assert thread_clock.busiest_thread(spent, pid) == main
        assert thread_clock.busiest_thread(spent, pid + 10**7) is None
        alone = max(before)
        rest = frozenset(before - {alone}) or frozenset({alone})
        thread_clock.pin([pid], rest, main, alone)
        assert os.sched_getaffinity(0) == {alone}
        assert sleeper.native_id is not None
        assert os.sched_getaffinity(sleeper.native_id) == rest
    finally:
        os.sched_setaffinity(0, before)
        idle.set()
        sleeper.join()

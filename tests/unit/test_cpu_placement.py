"""--engine-cpu: which CPU the stepping thread gets, and when auto leaves it to Linux."""

from __future__ import annotations

import os
import threading

import pytest

from worker.cpu_placement import EngineCpus, engine_cpus, pin_calling_thread


def test_auto_pins_only_inside_a_cpu_set_given_to_the_worker() -> None:
    # Four CPUs of a sixteen-CPU machine (taskset, --cpuset-cpus): the first is the stepper's.
    assert engine_cpus("auto", allowed={4, 5, 6, 7}, online=16) == EngineCpus(
        4, frozenset({5, 6, 7})
    )
    # The whole machine: shared with whatever else runs there, so left to the scheduler.
    assert engine_cpus("auto", allowed=set(range(16)), online=16) is None
    # One CPU: nothing to share out.
    assert engine_cpus("auto", allowed={3}, online=16) is None
    assert engine_cpus("off", allowed={4, 5, 6, 7}, online=16) is None


def test_a_cpu_number_is_taken_when_the_worker_may_use_it() -> None:
    assert engine_cpus("6", allowed={4, 5, 6, 7}, online=8) == EngineCpus(6, frozenset({4, 5, 7}))
    with pytest.raises(ValueError, match="may use CPUs 4,5,6,7; name one"):
        engine_cpus("9", allowed={4, 5, 6, 7}, online=16)
    with pytest.raises(ValueError, match="only CPU 2; the other threads need another"):
        engine_cpus("2", allowed={2}, online=16)
    with pytest.raises(ValueError, match="give auto, off or a CPU number"):
        engine_cpus("first", allowed={4, 5}, online=16)


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity"), reason="Linux CPU affinity")
def test_pinning_moves_the_calling_thread_alone() -> None:
    cpu = max(os.sched_getaffinity(0))
    seen: dict[str, set[int]] = {}

    def pinned() -> None:
        pin_calling_thread(cpu)
        seen["thread"] = os.sched_getaffinity(0)

    before = os.sched_getaffinity(0)
    thread = threading.Thread(target=pinned)
    thread.start()
    thread.join()
    assert seen["thread"] == {cpu}
    assert os.sched_getaffinity(0) == before  # the caller's thread kept its CPUs

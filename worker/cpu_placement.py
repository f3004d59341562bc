"""A CPU of its own for the engine's stepping thread (Linux).

The stepping thread is the worker's bottleneck wherever a step is short: it runs
exllamav2's host code between GPU launches, and every microsecond it waits for a CPU
lengthens the step. The worker's other threads (the event loop, the report relay, the
engine process's command reader, CUDA's helpers) wake once or more per step; Linux tends
to wake a thread that reads a pipe on the CPU of the thread that wrote it, which is the
stepping thread's. With ``--engine-cpu``, the stepping thread gets one CPU and every other
thread of the worker and of its engine process the rest of the CPUs the worker may use.

``auto`` does so only where the worker was given a set of CPUs smaller than the machine's
(docker --cpuset-cpus, Kubernetes' static CPU manager, taskset): CPUs that are the
worker's to share out. On a machine it shares with others, pinning a thread to a CPU that
other work also lands on would make things worse, so ``auto`` leaves it to the scheduler.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass


@dataclass(frozen=True)
class EngineCpus:
    stepper: int  # the stepping thread's CPU
    rest: frozenset[int]  # every other thread's

    def describe(self) -> str:
        return f"engine stepping thread on CPU {self.stepper}, other threads on CPUs " + ",".join(
            map(str, sorted(self.rest))
        )


def engine_cpus(
    choice: str, allowed: set[int] | None = None, online: int | None = None
) -> EngineCpus | None:
    """The placement ``choice`` ('auto', 'off' or a CPU number) asks for, or None to leave
    threads to the scheduler. ``allowed``: the CPUs this process may use; ``online``: the
    machine's CPU count (defaults: as Linux reports them). ValueError says what to fix."""
    if choice == "off" or not hasattr(os, "sched_setaffinity"):
        return None
    allowed = set(os.sched_getaffinity(0)) if allowed is None else set(allowed)
    online = (os.cpu_count() or len(allowed)) if online is None else online
    if choice == "auto":
        if len(allowed) < 2 or len(allowed) >= online:
            return None
        stepper = min(allowed)
    else:
        try:
            stepper = int(choice)
        except ValueError:
            raise ValueError(f"--engine-cpu {choice!r}: give auto, off or a CPU number") from None
        if stepper not in allowed:
            raise ValueError(
                f"--engine-cpu {choice}: this process may use CPUs {_ranges(allowed)}; name one"
            )
        if len(allowed) < 2:
            raise ValueError(
                f"--engine-cpu {choice}: this process may use only CPU {stepper}; the other "
                "threads need another"
            )
    return EngineCpus(stepper, frozenset(allowed - {stepper}))


def move_this_process(cpus: frozenset[int]) -> None:
    """Every thread of this process onto ``cpus``; threads started later inherit it from
    the thread that starts them."""
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError, ValueError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(tid), cpus)


def pin_calling_thread(cpu: int) -> None:
    """The calling thread alone onto ``cpu`` (Linux affinity is per thread)."""
    os.sched_setaffinity(0, {cpu})


def _ranges(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus)))

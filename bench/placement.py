"""Which CPUs each side of a bench run uses (Linux): the system under test (a generator, the
exlq worker, a model server) on a few CPUs of its own, the load (clients, Redis) on the rest.

In a deployment, producers and usually Redis run on other machines. Here they share one
machine with the worker; left to the scheduler, the clients and Redis landed on the CPUs
of the worker's stepping thread and slowed its 1-job step by 8-15% (docs/PERFORMANCE.md).
Every system gets the same treatment, so the comparisons stay fair.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

# CPUs the system under test gets under --worker-cpus auto: the worker's busy threads are
# the engine's stepping thread, its command reader, the event loop and the report relay.
AUTO_SERVER_CPUS = 4
AUTO_MIN_CPUS = 8


@dataclass(frozen=True)
class Placement:
    server: frozenset[int] | None  # None: no placement, the scheduler decides
    load: frozenset[int] | None

    def describe(self) -> str:
        if self.server is None or self.load is None:
            return "CPUs not assigned"
        return (
            f"system under test on CPUs {_ranges(self.server)}, "
            f"clients and Redis on {_ranges(self.load)}"
        )


def placement(spec: str) -> Placement:
    """'all': no placement. 'auto': the first AUTO_SERVER_CPUS allowed CPUs for the system
    under test when at least AUTO_MIN_CPUS are allowed. Else a list such as '0-3' or '0,2'."""
    if spec == "all" or not hasattr(os, "sched_getaffinity"):
        return Placement(None, None)
    allowed = sorted(os.sched_getaffinity(0))
    if spec == "auto":
        if len(allowed) < AUTO_MIN_CPUS:
            return Placement(None, None)
        server = set(allowed[:AUTO_SERVER_CPUS])
    else:
        server = _parse(spec)
        if not server <= set(allowed) or server == set(allowed):
            raise ValueError(
                f"--worker-cpus {spec}: name some, not all, of the CPUs this process may use "
                f"({_ranges(set(allowed))})"
            )
    return Placement(frozenset(server), frozenset(set(allowed) - server))


@contextmanager
def on_cpus(cpus: frozenset[int] | None) -> Iterator[None]:
    """The calling thread, and the threads and processes it starts meanwhile, on `cpus`."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


def _parse(spec: str) -> set[int]:
    cpus: set[int] = set()
    for part in spec.split(","):
        lo, _, hi = part.strip().partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def _ranges(cpus: set[int] | frozenset[int]) -> str:
    ordered = sorted(cpus)
    parts: list[str] = []
    start = prev = ordered[0]
    for cpu in [*ordered[1:], None]:
        if cpu is not None and cpu == prev + 1:
            prev = cpu
            continue
        parts.append(str(start) if start == prev else f"{start}-{prev}")
        if cpu is not None:
            start = prev = cpu
    return ",".join(parts)

"""Which CPUs each side of a bench run uses (Linux): the system under test (a generator, the
exlq worker, a model server) on a few CPUs of its own, the load (clients, Redis) on the rest.

In a deployment, producers and usually Redis run on other machines. Here they share one
machine with the worker; left to the scheduler, the clients and Redis landed on the CPUs
of the worker's stepping thread and slowed its 1-job step by 8-15% (docs/PERFORMANCE.md).
Every system gets the same treatment, so the comparisons stay fair.

On a machine with SMT, two CPUs of one core share its execution units: a client busy on
the sibling of the worker's stepping thread slows the step as if it shared the CPU. So
`auto` takes CPUs of distinct cores for the system under test and leaves their siblings
idle.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

# CPUs the system under test gets under --worker-cpus auto: the worker's busy threads are
# the engine's stepping thread, its command reader, the event loop and the report relay.
AUTO_SERVER_CPUS = 4
AUTO_MIN_CPUS = 8


@dataclass(frozen=True)
class Placement:
    server: frozenset[int] | None  # None: no placement, the scheduler decides
    load: frozenset[int] | None
    idle: frozenset[int] = frozenset()  # SMT siblings of the server's CPUs, left unused

    def describe(self) -> str:
        if self.server is None or self.load is None:
            return "CPUs not assigned"
        text = (
            f"system under test on CPUs {_ranges(self.server)}, "
            f"clients and Redis on {_ranges(self.load)}"
        )
        if self.idle:
            text += f", their SMT siblings {_ranges(self.idle)} idle"
        return text


def placement(
    spec: str,
    siblings_of: Callable[[int], frozenset[int]] | None = None,
    allowed: set[int] | None = None,
) -> Placement:
    """'all': no placement. 'auto': AUTO_SERVER_CPUS allowed CPUs on distinct cores for the
    system under test, when at least AUTO_MIN_CPUS are allowed; the load gets the CPUs of
    the other cores. Else 'SERVER' (e.g. '0-3': the load gets the rest, less the SMT
    siblings of SERVER) or 'SERVER:LOAD' (e.g. '0-3:4-15', exactly as given).

    ``siblings_of(cpu)`` gives the CPUs that share cpu's core, cpu included, and
    ``allowed`` the CPUs to place on (defaults: as Linux reports them for this process)."""
    if spec == "all" or not hasattr(os, "sched_getaffinity"):
        return Placement(None, None)
    siblings_of = siblings_of or smt_siblings
    allowed = set(os.sched_getaffinity(0)) if allowed is None else allowed
    server_spec, has_load, load_spec = spec.partition(":")
    if server_spec == "auto":
        if has_load:
            raise ValueError(f"--worker-cpus {spec}: auto takes no ':LOAD'")
        if len(allowed) < AUTO_MIN_CPUS:
            return Placement(None, None)
        server: set[int] = set()
        for cpu in sorted(allowed):
            if len(server) < AUTO_SERVER_CPUS and not siblings_of(cpu) & server:
                server.add(cpu)
        if len(server) < AUTO_SERVER_CPUS:  # fewer cores than that: share them
            server |= set(sorted(allowed - server)[: AUTO_SERVER_CPUS - len(server)])
    else:
        server = parse_cpus(server_spec)
    if has_load:
        load = parse_cpus(load_spec)
    else:
        load = allowed - server - _siblings(server, siblings_of)
        if not load:  # every core is the server's: share the siblings
            load = allowed - server
    _check(spec, server, load, allowed)
    idle = (allowed - server - load) & _siblings(server, siblings_of)
    return Placement(frozenset(server), frozenset(load), frozenset(idle))


def stepper_cpu(spec: str, place: Placement) -> int | None:
    """The one CPU for the stepping threads of the systems compared: 'auto' takes the last of
    the system's CPUs (none without a placement of two or more), 'none' leaves them where the
    scheduler puts them, a number names it (one of the system's CPUs)."""
    if spec == "none":
        return None
    if spec == "auto":
        return max(place.server) if place.server is not None and len(place.server) > 1 else None
    try:
        cpu = int(spec)
    except ValueError:
        raise ValueError(f"--stepper-cpu {spec}: give auto, none or a CPU number") from None
    if place.server is None or cpu not in place.server or len(place.server) < 2:
        raise ValueError(
            f"--stepper-cpu {spec}: name one of the system's CPUs "
            f"({place.describe()}), which must number two or more"
        )
    return cpu


def smt_siblings(cpu: int) -> frozenset[int]:
    """The CPUs that share cpu's core (cpu included), as Linux lists them; {cpu} if unknown."""
    path = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology/thread_siblings_list")
    try:
        return frozenset(parse_cpus(path.read_text().strip())) | {cpu}
    except (OSError, ValueError):
        return frozenset({cpu})


def _siblings(cpus: set[int], siblings_of: Callable[[int], frozenset[int]]) -> set[int]:
    out: set[int] = set()
    for cpu in cpus:
        out |= siblings_of(cpu)
    return out - cpus


def _check(spec: str, server: set[int], load: set[int], allowed: set[int]) -> None:
    where = f"the CPUs this process may use are {_ranges(allowed)}"
    if not server or not server <= allowed or server == allowed:
        raise ValueError(f"--worker-cpus {spec}: name some, not all, of the CPUs: {where}")
    if not load or not load <= allowed:
        raise ValueError(f"--worker-cpus {spec}: the load needs CPUs of its own: {where}")
    if server & load:
        raise ValueError(
            f"--worker-cpus {spec}: CPUs {_ranges(server & load)} are in both the system "
            "under test and the load"
        )


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


def parse_cpus(spec: str) -> set[int]:
    """A Linux CPU list ("0-3,8,10-11") as a set of CPU numbers."""
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

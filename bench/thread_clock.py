"""Where a system's threads spent a run (Linux): time on a CPU, time runnable but waiting
for one, and how often the scheduler took the CPU away, per thread, from
/proc/PID/task/TID/schedstat and status.

It tells apart the reasons a stepping thread can take longer per step than the same code
elsewhere: more CPU time for the same work (a slower or shared core), waits in the run
queue (another thread on its CPU), or neither (it slept: on the GPU, on a lock).

    before = snapshot([pid]); ...; spent = diff(before, snapshot([pid])); busiest(spent)
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

# (pid, tid) -> its counters
Snapshot = dict[tuple[int, int], "ThreadTimes"]


@dataclass(frozen=True)
class ThreadTimes:
    run_ns: int  # on a CPU
    wait_ns: int  # runnable, waiting for a CPU
    preempted: int  # nonvoluntary context switches
    cpu: int = -1  # the CPU it last ran on (-1: unknown)

    def minus(self, earlier: ThreadTimes) -> ThreadTimes:
        return ThreadTimes(
            self.run_ns - earlier.run_ns,
            self.wait_ns - earlier.wait_ns,
            self.preempted - earlier.preempted,
            self.cpu,
        )


def snapshot(pids: list[int]) -> Snapshot:
    """Every thread of these processes now; threads that end meanwhile are left out."""
    out: Snapshot = {}
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            times = _read(Path(f"/proc/{pid}/task/{tid}"))
            if times is not None:
                out[(pid, tid)] = times
    return out


def children(pid: int) -> list[int]:
    """The process's direct children (the worker's engine process)."""
    found: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:  # the process is gone
        return found
    for tid in tids:
        try:
            text = Path(f"/proc/{pid}/task/{tid}/children").read_text()
        except OSError:  # that thread ended meanwhile; its siblings still count
            continue
        found += [int(c) for c in text.split()]
    return found


def spawned_child(pid: int) -> int | None:
    """The child that multiprocessing spawned to run a target (the worker's engine process),
    not its resource tracker."""
    for child in children(pid):
        try:
            cmdline = Path(f"/proc/{child}/cmdline").read_bytes()
        except OSError:
            continue
        if b"spawn_main" in cmdline and b"resource_tracker" not in cmdline:
            return child
    return None


def diff(before: Snapshot, after: Snapshot) -> dict[tuple[int, int], ThreadTimes]:
    """Per thread alive at both ends, what it spent in between."""
    return {key: after[key].minus(before[key]) for key in after.keys() & before.keys()}


def busiest(spent: dict[tuple[int, int], ThreadTimes], pid: int | None = None) -> ThreadTimes:
    """The thread (of ``pid``, if given) with the most time on a CPU: a stepping thread."""
    pool = [t for (p, _), t in spent.items() if pid is None or p == pid]
    if not pool:
        return ThreadTimes(0, 0, 0)
    return max(pool, key=lambda t: t.run_ns)


def busiest_thread(spent: dict[tuple[int, int], ThreadTimes], pid: int) -> int | None:
    """The id of ``pid``'s thread with the most time on a CPU (its stepping thread), or None
    if none of its threads was seen."""
    mine = [(times.run_ns, tid) for (p, tid), times in spent.items() if p == pid]
    return max(mine)[1] if mine else None


def pin(pids: list[int], cpus: frozenset[int], thread: int | None = None, on: int = -1) -> None:
    """Every thread of these processes on ``cpus``; ``thread``, if given, alone on CPU ``on``.
    A thread that starts later takes the CPUs of the thread that starts it."""
    for _, tid in snapshot(pids):
        try:
            os.sched_setaffinity(tid, {on} if tid == thread else cpus)
        except ProcessLookupError:  # it ended meanwhile
            continue


def total_run_ns(spent: dict[tuple[int, int], ThreadTimes]) -> int:
    return sum(t.run_ns for t in spent.values())


def _read(task: Path) -> ThreadTimes | None:
    try:
        run_ns, wait_ns, _ = (int(x) for x in (task / "schedstat").read_text().split())
        status = (task / "status").read_text()
    except (OSError, ValueError):
        return None
    preempted = 0
    for line in status.splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            preempted = int(line.split()[1])
    return ThreadTimes(run_ns, wait_ns, preempted, _last_cpu(task))


def _last_cpu(task: Path) -> int:
    """Field 39 of the task's stat, `processor`; the name in field 2 may hold spaces and
    parentheses, so fields are counted from the last ')'."""
    try:
        fields = (task / "stat").read_text().rpartition(")")[2].split()
        return int(fields[39 - 3])
    except (OSError, ValueError, IndexError):
        return -1


def stepper_figures(
    spent: dict[tuple[int, int], ThreadTimes], steps: int, pid: int | None = None
) -> dict[str, float]:
    """Per step of a run: the stepping thread's (the busiest of ``pid``) time on a CPU, its
    waits for one and its preemptions, and every other thread's CPU time together; and the
    CPU the stepping thread last ran on (stepper_cpu, -1 if unknown)."""
    if steps <= 0:
        return {}
    stepper = busiest(spent, pid)
    return {
        "stepper_run_us_per_step": stepper.run_ns / steps / 1000,
        "stepper_wait_us_per_step": stepper.wait_ns / steps / 1000,
        "stepper_preempted_per_step": stepper.preempted / steps,
        "others_run_us_per_step": (total_run_ns(spent) - stepper.run_ns) / steps / 1000,
        "stepper_cpu": stepper.cpu,
    }

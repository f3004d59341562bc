"""Priority lanes: how a worker shares its free slots between a queue's lanes.

Each lane of a queue is a stream of its own (keys.QueueKeys.lane_jobs), read through the
same consumer group. A read fills free slots from the interactive lane first and gives the
batch lane what is left, with two bounds an operator sets:

- ``batch_min_slots``: the batch lane may always run this many jobs, however busy the
  interactive lane is. It is the starvation bound: while batch jobs wait, at least this many
  run, so a batch always progresses (at no less than this share of the worker).
- ``interactive_reserved_slots``: the batch lane never fills the last this many slots, so an
  interactive job that arrives while a batch runs finds a free slot at once instead of
  waiting for a batch job to end.

A read is a plan: (lane, cap) steps in order, taken by one script (broker_scripts.TAKE_LUA)
up to the free slots in all. Where the batch lane runs fewer than its minimum, it comes
first, up to the shortfall; then the interactive lane, up to every free slot; then the batch
lane again, up to what the reserve leaves it.

A read that finds both lanes empty waits on both, or on the interactive lane alone when it
has one free slot (a wait on two streams can bring an entry from each). So a worker with one
free slot starts a batch job that lands while it waits only after the wait ends
(``read_block_ms``): a batch job waits at most that much longer, an interactive one never.
While the reserve holds the batch lane back, the wait is RESERVE_RECHECK_MS: a batch job
that ends frees a slot the batch lane may fill, and a waiting read would not see it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from exlq.protocol.keys import LANES, Lane

# While the reserve holds the batch lane back, a read that finds nothing waits this long at
# most (for an interactive entry) before it looks again: a batch job ends every few steps
# at full load, and a wait of the usual read_block_ms (1 s) would leave its slot empty.
RESERVE_RECHECK_MS = 20


@dataclass(frozen=True, slots=True)
class TakePlan:
    """What one read may take: at most ``total`` entries; per step, a lane and the most that
    lane may bring in this read counting its earlier steps."""

    total: int
    steps: tuple[tuple[Lane, int], ...]
    # The reserve holds the batch lane back though slots are free: a batch job that ends
    # lets it take one more, so a read that finds nothing waits only RESERVE_RECHECK_MS.
    held_back: bool = False

    @classmethod
    def any_lane(cls, total: int) -> TakePlan:
        """Up to ``total`` entries, from the lanes in priority order, with no other bound."""
        return cls(total, tuple((lane, total) for lane in LANES))

    def lanes(self) -> list[Lane]:
        """The lanes the plan can take from, highest first: a read that finds nothing waits
        on these, on as many as it has slots for."""
        return [lane for lane in LANES if any(cap > 0 for on, cap in self.steps if on == lane)]

    def after_wait(self, waited_on: Sequence[Lane]) -> TakePlan:
        """The plan for the take sent behind a wait on ``waited_on``, which may bring one
        entry from each of those lanes: the take does not see what the wait brought, so it
        takes one fewer in all and from each of those lanes. (Where the wait brought less,
        the read says it may have left entries behind, and the worker reads them next.)"""
        steps = tuple((lane, max(cap - (lane in waited_on), 0)) for lane, cap in self.steps)
        return TakePlan(max(self.total - len(waited_on), 0), steps, self.held_back)

    def less(self, taken: Mapping[Lane, int], total: int = 0) -> TakePlan:
        """The plan with ``total`` fewer entries in all and, per lane, ``taken[lane]`` fewer
        from that lane: what is left of it once those are in hand."""
        steps = tuple((lane, max(cap - taken.get(lane, 0), 0)) for lane, cap in self.steps)
        return TakePlan(max(self.total - total, 0), steps, self.held_back)

    def lane_bounds(self) -> dict[Lane, int]:
        """The most each lane may bring in this read (its last step's cap)."""
        return {lane: max(cap for on, cap in self.steps if on == lane) for lane in self.lanes()}

    def split(self, parts: int) -> list[TakePlan]:
        """``parts`` plans that together take no more than this one, in all and from each
        lane: each count shared as evenly as it goes, the odd ones to the first parts."""
        return [
            TakePlan(
                _share(self.total, parts, i),
                tuple((lane, _share(cap, parts, i)) for lane, cap in self.steps),
                self.held_back,
            )
            for i in range(parts)
        ]

    def wait_ms(self, block_ms: int) -> int:
        """How long a read that finds nothing may wait for an entry."""
        return min(block_ms, RESERVE_RECHECK_MS) if self.held_back else block_ms


@dataclass(frozen=True, slots=True)
class LanePolicy:
    capacity: int
    batch_min_slots: int
    interactive_reserved_slots: int

    def plan(self, free_slots: int, running: Mapping[Lane, int]) -> TakePlan:
        """The read for ``free_slots`` slots, with ``running`` jobs held per lane."""
        batch_running = running.get("batch", 0)
        shortfall = max(self.batch_min_slots - batch_running, 0)
        # The batch lane's room beside the interactive reserve, never under its minimum.
        room = self.capacity - self.interactive_reserved_slots - batch_running
        batch_cap = max(room, shortfall, 0)
        steps: list[tuple[Lane, int]] = []
        if shortfall:
            steps.append(("batch", min(shortfall, free_slots)))
        steps.append(("interactive", free_slots))
        steps.append(("batch", min(batch_cap, free_slots)))
        return TakePlan(free_slots, tuple(steps), held_back=free_slots > 0 and batch_cap == 0)


def _share(count: int, parts: int, index: int) -> int:
    return count // parts + (1 if index < count % parts else 0)


def count_by_lane(lanes: Iterable[Lane]) -> dict[Lane, int]:
    counts: dict[Lane, int] = dict.fromkeys(LANES, 0)
    for lane in lanes:
        counts[lane] += 1
    return counts

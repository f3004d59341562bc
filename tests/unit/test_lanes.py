"""How a worker shares its free slots between the priority lanes (worker/lanes.py)."""

from __future__ import annotations

from exlq.protocol.keys import QueueKeys, entry_ref, split_entry_ref
from exlq.worker.lanes import RESERVE_RECHECK_MS, LanePolicy, TakePlan, count_by_lane


def test_interactive_jobs_take_every_free_slot_once_the_batch_minimum_runs() -> None:
    policy = LanePolicy(capacity=8, batch_min_slots=1, interactive_reserved_slots=1)
    plan = policy.plan(4, {"interactive": 3, "batch": 1})
    assert plan.total == 4
    assert plan.steps[0] == ("interactive", 4)


def test_a_batch_lane_below_its_minimum_comes_first_up_to_the_shortfall() -> None:
    policy = LanePolicy(capacity=8, batch_min_slots=3, interactive_reserved_slots=1)
    plan = policy.plan(5, {"interactive": 2, "batch": 1})
    assert plan.steps[:2] == (("batch", 2), ("interactive", 5))


def test_the_batch_lane_leaves_the_reserved_slots_free() -> None:
    policy = LanePolicy(capacity=8, batch_min_slots=1, interactive_reserved_slots=2)
    # 5 batch jobs run: the batch lane may fill one more slot, never the last two.
    assert policy.plan(3, {"interactive": 0, "batch": 5}).steps[-1] == ("batch", 1)
    assert policy.plan(2, {"interactive": 0, "batch": 6}).steps[-1] == ("batch", 0)


def test_the_batch_minimum_holds_against_the_reserve() -> None:
    policy = LanePolicy(capacity=2, batch_min_slots=2, interactive_reserved_slots=2)
    plan = policy.plan(2, {"interactive": 0, "batch": 0})
    assert plan.steps[0] == ("batch", 2)
    assert plan.steps[-1] == ("batch", 2)


def test_a_read_with_one_free_slot_waits_on_the_interactive_lane_first() -> None:
    policy = LanePolicy(capacity=4, batch_min_slots=1, interactive_reserved_slots=0)
    plan = policy.plan(1, {"interactive": 3, "batch": 0})
    assert plan.steps[0] == ("batch", 1)  # a batch job waiting is taken first...
    assert plan.lanes() == ["interactive", "batch"]  # ...but a wait watches interactive first
    assert plan.after_wait(["interactive"]).total == 0


def test_the_take_behind_a_wait_leaves_room_for_what_the_wait_brings() -> None:
    # Four free slots, one held back for interactive jobs: the batch lane may bring three.
    policy = LanePolicy(capacity=4, batch_min_slots=1, interactive_reserved_slots=1)
    plan = policy.plan(4, {"interactive": 0, "batch": 0})
    rest = plan.after_wait(plan.lanes())
    # The wait may bring a job from each lane: the take behind it brings two at most, and
    # the batch lane two at most of them, so the read holds three batch jobs at most.
    assert rest.total == 2
    assert max(cap for lane, cap in rest.steps if lane == "batch") == 2
    assert max(cap for lane, cap in rest.steps if lane == "interactive") == 3


def test_entry_names_carry_their_lane_and_the_batch_lane_has_its_own_stream() -> None:
    assert entry_ref("17-0", "interactive") == "17-0"
    assert entry_ref("17-0", "batch") == "17-0@batch"
    assert split_entry_ref("17-0@batch") == ("17-0", "batch")
    assert split_entry_ref("17-0") == ("17-0", "interactive")
    keys = QueueKeys("q")
    assert keys.lane_jobs("interactive") == keys.jobs
    assert keys.lane_jobs("batch") == "exlq:{q}:jobs:batch"
    assert count_by_lane(["batch", "batch", "interactive"]) == {"interactive": 1, "batch": 2}
    assert TakePlan.any_lane(3).lanes() == ["interactive", "batch"]


def test_a_read_held_back_by_the_reserve_waits_briefly() -> None:
    """Batch jobs fill every slot but the reserve: a batch job that ends frees a slot the
    batch lane may take, so the read that waits for interactive jobs must not wait long."""
    policy = LanePolicy(capacity=8, batch_min_slots=1, interactive_reserved_slots=2)
    held = policy.plan(2, {"interactive": 0, "batch": 6})
    assert held.held_back and held.wait_ms(1000) == RESERVE_RECHECK_MS
    free = policy.plan(3, {"interactive": 0, "batch": 5})
    assert not free.held_back and free.wait_ms(1000) == 1000

"""The operator tools' view of a queue split in partitions, without Redis: a partition's keys
name its queue (never a queue "Q/n"), a partition's lanes merge into the queue's, and a dead
letter's name says its partition."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from exlq.ops.queue_stats import (
    LaneStats,
    QueueNames,
    merge_lanes,
    partition_name,
    split_partition_name,
)
from exlq.protocol.keys import QueueKeys


def test_the_keys_of_every_partition_name_their_queue() -> None:
    named = QueueNames("exlq")
    keys = QueueKeys("demo.q:1", "exlq")
    for n in range(4):
        part = keys.of_partition(n)
        for key in (part.jobs, part.lane_jobs("batch"), part.dead, part.workers):
            assert named.by(key) == "demo.q:1", key
    assert named.by(keys.partitions) == "demo.q:1"  # a count alone is a queue's mark
    for not_a_queue in (
        "exlq:{demo/0}:jobs",  # partition 0 is the queue's own tag, never {Q/0}
        "exlq:{demo/x}:jobs",
        "exlq:{demo/3/4}:jobs",
        "exlq:{demo/3}:job:1",
        "other:{demo/3}:jobs",
    ):
        assert named.by(not_a_queue) is None, not_a_queue


def _lane(**fields: object) -> LaneStats:
    base: dict[str, object] = {
        "lane": "interactive",
        "length": 0,
        "has_group": False,
        "waiting": 0,
        "waiting_exact": True,
        "pending": 0,
        "oldest_waiting_s": 0.0,
        "oldest_pending_s": 0.0,
    }
    return LaneStats(**{**base, **fields})  # type: ignore[arg-type]


def test_a_queues_lanes_sum_its_partitions_and_take_the_oldest_ages() -> None:
    first = (
        _lane(length=5, has_group=True, waiting=3, pending=2, oldest_waiting_s=1.5),
        _lane(lane="batch", length=1, waiting=1, oldest_waiting_s=9.0),
    )
    third = (
        _lane(length=7, waiting=6, waiting_exact=False, oldest_pending_s=4.0),
        _lane(lane="batch", length=2, has_group=True, waiting=2, pending=0),
    )
    interactive, batch = merge_lanes([first, third])
    assert interactive == _lane(
        length=12,
        has_group=True,
        waiting=9,
        waiting_exact=False,  # one partition's count stopped at the cap
        pending=2,
        oldest_waiting_s=1.5,
        oldest_pending_s=4.0,
    )
    assert batch == _lane(lane="batch", length=3, has_group=True, waiting=3, oldest_waiting_s=9.0)
    assert merge_lanes([first]) is first  # one partition: its own numbers


@given(st.from_regex(r"[0-9]{1,13}-[0-9]{1,5}", fullmatch=True), st.integers(0, 255))
def test_a_dead_letters_name_gives_back_its_id_and_partition(entry_id: str, n: int) -> None:
    name = partition_name(entry_id, n)
    assert split_partition_name(name) == (entry_id, n)
    assert (name == entry_id) == (n == 0)  # a queue of one partition names them as before


def test_a_name_whose_partition_is_no_number_names_nothing() -> None:
    assert split_partition_name("1-0#x") is None
    assert split_partition_name("1-0#") is None

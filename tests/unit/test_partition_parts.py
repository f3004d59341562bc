"""The pieces of a partitioned queue that need no Redis: where an id goes, how a worker
names entries of several partitions, how a read's plan is shared, how a batch is split."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis
from hypothesis import given
from hypothesis import strategies as st

from exlq.protocol.keys import QueueKeys, entry_ref, partition_of, split_entry_ref
from exlq.protocol.partition_count import parse_count
from exlq.worker.broker import Broker
from exlq.worker.commit_batch import Batch, Final
from exlq.worker.lanes import LanePolicy, TakePlan
from exlq.worker.partitions import PartitionedBroker, _split_batch, tag, untag


def test_an_id_picks_its_partition_by_the_standard_crc32() -> None:
    # CRC-32's published check value: the CRC of "123456789" is 0xCBF43926, so a producer
    # in any language that has CRC-32 places ids as exlq does.
    assert partition_of("123456789", 7) == 0xCBF43926 % 7
    assert partition_of("anything", 1) == 0


def test_partition_keys_have_their_own_tag_and_share_the_queues_channels() -> None:
    keys = QueueKeys("demo", "exlq")
    third = keys.of_partition(3)
    assert third.jobs == "exlq:{demo/3}:jobs"
    assert third.job("a") == "exlq:{demo/3}:job:a"
    assert third.shard_events("a") == "exlq:{demo/3}:out:a"
    assert keys.of_partition(0) == keys
    assert third.cancel == keys.cancel == "exlq:{demo}:cancel"
    assert third.workers == keys.workers
    assert third.partitions == keys.partitions == "exlq:{demo}:partitions"
    with pytest.raises(ValueError, match="partition"):
        keys.of_partition(-1)


@given(
    st.from_regex(r"[0-9]{1,13}-[0-9]{1,5}", fullmatch=True),
    st.sampled_from(["interactive", "batch"]),
    st.integers(0, 255),
)
def test_an_entry_of_any_partition_keeps_its_id_and_lane(
    entry_id: str, lane: str, partition: int
) -> None:
    ref = entry_ref(entry_id, lane)  # type: ignore[arg-type]
    name = tag(ref, partition)
    assert untag(name) == (ref, partition)
    assert split_entry_ref(name)[1] == lane


@given(st.integers(0, 64), st.integers(0, 64), st.integers(0, 8), st.integers(1, 9))
def test_a_plan_shared_between_partitions_never_takes_more(
    free: int, batch_running: int, reserved: int, parts: int
) -> None:
    policy = LanePolicy(capacity=64, batch_min_slots=2, interactive_reserved_slots=reserved)
    plan = policy.plan(free, {"batch": min(batch_running, 64 - free)})
    shares = plan.split(parts)
    assert sum(s.total for s in shares) == plan.total
    for lane, bound in plan.lane_bounds().items():
        assert sum(s.lane_bounds().get(lane, 0) for s in shares) <= bound
    assert max(s.total for s in shares) - min(s.total for s in shares) <= 1


def test_what_is_left_of_a_plan_counts_what_was_taken() -> None:
    plan = TakePlan(6, (("batch", 2), ("interactive", 6), ("batch", 3)))
    left = plan.less({"batch": 2, "interactive": 1}, 3)
    assert left.total == 3
    assert left.steps == (("batch", 0), ("interactive", 5), ("batch", 1))


def test_a_batch_goes_to_each_partition_in_its_order() -> None:
    batch = Batch(lease_until_ms=7)
    batch.publish("c1", "e1", tag("1-0", 2))
    batch.publish("c0", "e2", "5-0")
    batch.publish("c1", "e3", tag("1-0", 2))
    batch.finish(Final(tag("1-0@batch", 2), job_id="j"))
    shares = _split_batch(batch)
    assert shares[2].publishes == [("c1", "e1", "1-0"), ("c1", "e3", "1-0")]
    assert shares[2].finals == [Final("1-0@batch", job_id="j")]
    assert shares[0].publishes == [("c0", "e2", "5-0")]
    assert shares[2].lease_until_ms == shares[0].lease_until_ms == 7


def test_a_hand_written_count_that_is_not_one_reads_as_one() -> None:
    assert parse_count(None) == 1
    assert parse_count(b"4") == 4
    assert parse_count(b"0") == parse_count(b"many") == parse_count(b"100000") == 1


async def test_a_batch_sent_before_the_queue_grew_is_sent_again_whole(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker whose queue grew while a batch's reply was lost sends that batch again as
    it first went (its answered calls send nothing twice); a new batch goes in shares."""
    sent: list[tuple[Broker, Batch]] = []

    async def commit(self: Broker, batch: Batch, whole: Batch | None = None) -> list[Any]:
        sent.append((self, batch))
        return []

    monkeypatch.setattr(Broker, "commit", commit)
    client = aioredis.Redis()  # never connects here
    plain = Broker(client, QueueKeys("q"), "w", result_ttl_s=1, dead_max_len=1)
    grown = PartitionedBroker.around(plain, 2)
    before = Batch(name="first:7")
    before.publish("c", "e", "1-0")
    await grown.commit(before)
    assert sent == [(grown, before)]
    after = Batch()
    after.publish("c", "e", tag("2-0", 1))
    await grown.commit(after)
    assert after.parts is not None and sent[-1] == (grown.parts[1], after.parts[1])
    await grown.close()

"""PartitionedBroker: a queue split into partitions, read and written as one queue.

A queue hotter than one shard of a Redis Cluster can be split in partitions (keys.QueueKeys
.partition): partition 0 is the queue's own keys, partition n > 0 has its own hash tag
``{Q/n}``, so a cluster spreads the partitions over its masters. Producers place each job in
the partition its id picks (keys.partition_of), so every key of a job, its entry and its
events' shard channel share one slot, and each script the worker sends stays in one slot:
a job's guarantees (one result, ordered events, dedupe by id) are those of a queue of one
partition. The cancel channel and the heartbeats stay the queue's.

A worker reads every partition. A read shares its free slots as evenly as they go between
the partitions, starting at the next partition each time, and takes in rounds: what a
partition that had less than its share leaves goes to those that filled theirs. Lane bounds
(worker/lanes.py) are shared the same way, so no read takes more from a lane than its plan
allows. Where no partition has an entry, the worker waits on each partition at once (one
blocking read each, on its own node), with the free slots shared between the waits, at
most WAIT_ENTRIES a wait; the first entry ends the read, and the other waits stay in
flight, each holding the slots it may fill (``reserved_slots``) until it returns. With
fewer free slots than partitions, some partitions have no wait: the waits then last
UNWATCHED_RECHECK_MS, and the next read starts at the next partitions.

An entry of partition n > 0 is named ``<id>#<n>`` (before the lane mark), so that entries of
two partitions never share a name in the worker.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import Counter
from collections.abc import Awaitable, Iterable, Sequence
from typing import Any

from exlq.protocol.command_packing import pack_in_c
from exlq.protocol.keys import LANE_MARK, Lane, QueueKeys
from exlq.protocol.partition_count import parse_count, raise_count
from exlq.protocol.slot_routing import client_like
from exlq.worker.broker import Broker, Read, StartDecision, StreamEntry
from exlq.worker.commit_batch import Batch
from exlq.worker.lanes import TakePlan

log = logging.getLogger(__name__)

PARTITION_TAG = "#"
# The most a wait on one partition may bring (the first entry of each lane), and so the
# slots it holds while in flight: what lands behind that first entry is read at once after
# it, so a worker's waits keep few of its slots from a reclaim.
WAIT_ENTRIES = 2
# A wait that leaves partitions unwatched (fewer free slots than partitions) lasts this long
# at most, so that the next read looks at those.
UNWATCHED_RECHECK_MS = 50
# How long a stopping worker waits for its waits in flight (each lasts read_block_ms).
FINISH_READS_S = 15.0
# A partition whose node failed is left out of reads this long (a failover under way), so
# that reads of the others go on meanwhile.
DOWN_RETRY_S = 1.0


async def with_partitions(broker: Broker, wanted: int) -> Broker:
    """The broker of every partition of ``broker``'s queue: the queue's count, raised to
    ``wanted`` if it is lower (exlq/protocol/partition_count.py); ``broker`` itself for a
    queue of one partition."""
    count = await raise_count(broker.client, broker.keys, wanted)
    if count == 1:
        return broker
    if count > wanted:
        log.info("queue %r has %d partitions; reading them all", broker.keys.queue, count)
    return PartitionedBroker.around(broker, count)


async def follow_count(broker: Broker) -> Broker:
    """The broker of every partition the queue has now: where the count was raised since
    ``broker`` was made (another worker started with a higher EXLQ_PARTITIONS), the new
    partitions join, their consumer groups made; else ``broker`` as it is."""
    count = parse_count(await broker.client.get(broker.keys.partitions))
    if count <= len(broker.parts):
        return broker
    log.info("queue %r now has %d partitions; reading them all", broker.keys.queue, count)
    if isinstance(broker, PartitionedBroker):
        await broker.grow(count)
        return broker
    grown = PartitionedBroker.around(broker, count)
    await grown.ensure_group()
    await grown.find_sharded_pubsub()
    return grown


def tag(entry_ref: str, partition: int) -> str:
    """The name of an entry of ``partition`` in the worker."""
    if not partition:
        return entry_ref
    entry_id, mark, lane = entry_ref.partition(LANE_MARK)
    return f"{entry_id}{PARTITION_TAG}{partition}{mark}{lane}"


def untag(name: str) -> tuple[str, int]:
    """The entry's name in its partition (keys.entry_ref), and the partition."""
    entry_id, mark, lane = name.partition(LANE_MARK)
    head, found, partition = entry_id.partition(PARTITION_TAG)
    return (f"{head}{mark}{lane}", int(partition)) if found else (name, 0)


class PartitionedBroker(Broker):
    """The broker of a queue split in ``len(parts)`` partitions: itself for partition 0,
    a broker of its own (on its slot's node) for each other."""

    def __init__(self, *args: Any, others: Sequence[Broker], **options: Any) -> None:
        super().__init__(*args, **options)
        self.parts = [self, *others]
        self._turn = 0
        self._waits: dict[int, tuple[asyncio.Task[Read], TakePlan]] = {}
        self._down_until: dict[int, float] = {}

    @classmethod
    def around(cls, base: Broker, partitions: int) -> PartitionedBroker:
        """``base``'s queue split in ``partitions``: its client serves partition 0, and each
        other partition gets a client like it, reaching that partition's node."""
        others = [_partition_broker(base, n) for n in range(1, partitions)]
        return cls(base.client, base.keys, base.consumer, others=others, **_options(base))

    async def grow(self, partitions: int) -> None:
        """Read ``partitions`` partitions from now on: the new ones join, groups made."""
        added = [_partition_broker(self, n) for n in range(len(self.parts), partitions)]
        await _each(Broker.ensure_group(part) for part in added)
        await _each(Broker.find_sharded_pubsub(part) for part in added)
        self.parts += added
        self.sharded_pubsub = all(part.sharded_pubsub for part in self.parts)

    # -- the partitions as one -------------------------------------------------------------

    async def close(self) -> None:
        for task, _ in self._waits.values():
            task.cancel()
        for part in self.parts:
            await Broker.close(part)

    async def ensure_group(self) -> None:
        await _each(Broker.ensure_group(part) for part in self.parts)

    async def find_sharded_pubsub(self) -> None:
        await _each(Broker.find_sharded_pubsub(part) for part in self.parts)
        self.sharded_pubsub = all(part.sharded_pubsub for part in self.parts)

    def keys_of(self, entry_id: str) -> QueueKeys:
        return self.parts[untag(entry_id)[1]].keys

    @property
    def reserved_slots(self) -> int:
        return sum(plan.total for _, plan in self._waits.values())

    async def start_jobs(self, starts: list[tuple[str, str]]) -> list[StartDecision]:
        """Each partition's jobs in its own call; the decisions in ``starts``' order."""
        groups = self._grouped(starts)
        answers = await _each(Broker.start_jobs(self.parts[n], rows) for n, rows in groups.items())
        decided = {n: iter(rows) for n, rows in zip(groups, answers, strict=True)}
        return [next(decided[untag(name)[1]]) for _, name in starts]

    async def renew(self, jobs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        groups = self._grouped(jobs)
        lost = await _each(Broker.renew(self.parts[n], rows) for n, rows in groups.items())
        return [
            (tag(entry, n), why)
            for n, rows in zip(groups, lost, strict=True)
            for entry, why in rows
        ]

    async def cancel_flags(self, jobs: list[tuple[str, str]]) -> list[str]:
        flagged = await _each(
            Broker.cancel_flags(self.parts[n], rows) for n, rows in self._grouped(jobs).items()
        )
        return [job_id for rows in flagged for job_id in rows]

    async def announce_lost(
        self, job_id: str, entry_id: str, channel: str, event_json: str
    ) -> bool:
        entry, n = untag(entry_id)
        return await Broker.announce_lost(self.parts[n], job_id, entry, channel, event_json)

    async def commit(self, batch: Batch, whole: Batch | None = None) -> list[tuple[str, str]]:
        """Each partition's share of the batch, written in its own call (in order within a
        partition, so a job's events stay in order); sent again, each share sends again
        only what its partition has not answered (Broker.commit)."""
        if batch.parts is None and batch.name is not None:
            # Sent before the queue grew, by the plain broker this one took over from: sent
            # again the same way, so that its answered calls send nothing twice.
            return await Broker.commit(self, batch, whole)
        if batch.parts is None:
            batch.parts = _split_batch(batch)
        shares = list(batch.parts.items())
        answers = await asyncio.gather(
            *(Broker.commit(self.parts[n], share) for n, share in shares),
            return_exceptions=True,
        )
        unwritten: list[tuple[str, str]] = []
        for (n, _), answer in zip(shares, answers, strict=True):
            if isinstance(answer, BaseException):
                raise answer  # the others are answered: sent again, they send nothing
            unwritten += [(tag(entry, n), why) for entry, why in answer]
        return unwritten

    async def reclaim(self, count: int, min_idle_ms: int) -> list[StreamEntry]:
        taken: list[StreamEntry] = []
        for n in self._rotation():
            if len(taken) >= count:
                break
            entries = await Broker.reclaim(self.parts[n], count - len(taken), min_idle_ms)
            taken += _tagged(entries, n)
        return taken

    async def trim(self) -> int:
        return int(sum(await _each(Broker.trim(part) for part in self.parts)))

    async def forget_idle_consumers(self, idle_ms: int) -> int:
        # A consumer is the same worker in every partition: count it once.
        counts = await _each(Broker.forget_idle_consumers(p, idle_ms) for p in self.parts)
        return int(max(counts))

    async def leave(self) -> None:
        await Broker.leave(self)
        for part in self.parts[1:]:
            await part.client.hdel(part.keys.commits, self.consumer)

    # -- reading -----------------------------------------------------------------------------

    async def read(self, plan: TakePlan, block_ms: int | None) -> Read:
        """Up to ``plan.total`` entries from the partitions (the module's docstring says how
        they share it). The waits in flight hold their slots out of the plan already
        (Worker.free_slots, and so the interactive lane's bound); the batch entries they
        may bring count against the batch lane's bound here."""
        plan = plan.less(self._batch_waiting())
        entries = self._harvest()
        if entries:
            return Read(entries, complete=False)
        entries, complete = await self._take_rounds(plan)
        if entries or block_ms is None:
            return Read(entries, complete)
        wait_ms = self._start_waits(plan, block_ms)
        if self._waits:
            tasks = [task for task, _ in self._waits.values()]
            await asyncio.wait(tasks, timeout=wait_ms / 1000, return_when=asyncio.FIRST_COMPLETED)
        entries = self._harvest()
        return Read(entries, complete=not entries)

    async def finish_reads(self) -> list[StreamEntry]:
        """What the waits in flight bring; a wait that has not ended within
        FINISH_READS_S (a connection that hangs) is given up: what Redis gave it stays
        pending, for a reclaim."""
        if self._waits:
            tasks = [task for task, _ in self._waits.values()]
            _, late = await asyncio.wait(tasks, timeout=FINISH_READS_S)
            for task in late:
                task.cancel()
            await asyncio.gather(*late, return_exceptions=True)
        return self._harvest()

    def _rotation(self) -> list[int]:
        """The partitions, from the next one in turn; those whose node failed lately last
        out."""
        now = time.monotonic()
        count = len(self.parts)
        first, self._turn = self._turn, (self._turn + 1) % count
        order = [(first + i) % count for i in range(count)]
        up = [n for n in order if self._down_until.get(n, 0.0) <= now]
        return up or order  # all down: ask them all, and let their errors show

    async def _take_rounds(self, plan: TakePlan) -> tuple[list[StreamEntry], bool]:
        """What the partitions hold, without waiting, taken in rounds; and whether that was
        all (False: it stopped at the plan's count)."""
        candidates, taken, error = self._rotation(), [], None
        while plan.total > 0 and candidates:
            shares = plan.split(len(candidates))
            asked = [(n, share) for n, share in zip(candidates, shares, strict=True) if share.total]
            unasked = [n for n, share in zip(candidates, shares, strict=True) if not share.total]
            answers = await asyncio.gather(
                *(self._take_now(n, share) for n, share in asked), return_exceptions=True
            )
            filled = []
            for (n, share), answer in zip(asked, answers, strict=True):
                if isinstance(answer, BaseException):
                    error = error or answer
                    self._down_until[n] = time.monotonic() + DOWN_RETRY_S
                    continue
                taken += answer
                plan = plan.less(Counter(entry.lane for entry in answer), len(answer))
                if len(answer) >= share.total:
                    filled.append(n)
            candidates = unasked + filled
        if error is not None and not taken:
            raise error
        return taken, plan.total > 0

    async def _take_now(self, partition: int, plan: TakePlan) -> list[StreamEntry]:
        entries, _ = await Broker._take_read(self.parts[partition], plan)
        return _tagged(entries, partition)

    def _start_waits(self, plan: TakePlan, block_ms: int) -> int:
        """Start a wait on each partition that has none and gets a share of ``plan``;
        returns how long they wait."""
        idle = [n for n in self._rotation() if n not in self._waits]
        shares = plan.split(len(idle)) if idle else []
        unwatched = len(self._waits) + sum(1 for s in shares if s.total) < len(self.parts)
        wait_ms = min(block_ms, UNWATCHED_RECHECK_MS) if unwatched else block_ms
        for n, share in zip(idle, shares, strict=True):
            share = _at_most(share, WAIT_ENTRIES)
            if share.total and share.lanes():
                read = Broker.read(self.parts[n], share, wait_ms)
                self._waits[n] = (asyncio.ensure_future(read), share)
        return wait_ms

    def _batch_waiting(self) -> dict[Lane, int]:
        """The most batch entries the waits in flight may bring."""
        return {
            "batch": sum(share.lane_bounds().get("batch", 0) for _, share in self._waits.values())
        }

    def _harvest(self) -> list[StreamEntry]:
        """The entries of the waits that have ended. A wait that failed brought nothing:
        its error comes back on the partition's next read."""
        entries: list[StreamEntry] = []
        for n, (task, _) in list(self._waits.items()):
            if not task.done():
                continue
            del self._waits[n]
            if task.cancelled() or task.exception() is not None:
                self._down_until[n] = time.monotonic() + DOWN_RETRY_S
                continue
            entries += _tagged(task.result().entries, n)
        return entries

    # -- helpers -----------------------------------------------------------------------------

    def _grouped(self, jobs: list[tuple[str, str]]) -> dict[int, list[tuple[str, str]]]:
        """(job_id, entry) pairs by partition, each entry named as its partition names it."""
        groups: dict[int, list[tuple[str, str]]] = {}
        for job_id, name in jobs:
            entry, n = untag(name)
            groups.setdefault(n, []).append((job_id, entry))
        return groups


def _at_most(plan: TakePlan, entries: int) -> TakePlan:
    return TakePlan(
        min(plan.total, entries),
        tuple((lane, min(cap, entries)) for lane, cap in plan.steps),
        plan.held_back,
    )


def _partition_broker(base: Broker, partition: int) -> Broker:
    """A broker of ``base``'s queue's partition, on a client like ``base``'s reaching its
    slot's node."""
    keys = base.keys.of_partition(partition)
    client = client_like(base.client, keys.jobs)
    pack_in_c(client.connection_pool)
    return Broker(client, keys, base.consumer, **_options(base))


def _options(base: Broker) -> dict[str, Any]:
    return {
        "result_ttl_s": base.result_ttl_s,
        "dead_max_len": base.dead_max_len,
        "max_entry_bytes": base.max_entry_bytes,
    }


def _tagged(entries: list[StreamEntry], partition: int) -> list[StreamEntry]:
    if not partition:
        return entries
    return [dataclasses.replace(e, entry_id=tag(e.entry_id, partition)) for e in entries]


def _split_batch(batch: Batch) -> dict[int, Batch]:
    """The batch as one batch per partition, each naming entries as its partition does."""
    shares: dict[int, Batch] = {}

    def share(n: int) -> Batch:
        found = shares.get(n)
        if found is None:
            found = shares[n] = Batch(lease_until_ms=batch.lease_until_ms)
        return found

    for channel, event_json, name in batch.publishes:
        entry, n = untag(name)
        share(n).publish(channel, event_json, entry)
    for final in batch.finals:
        entry, n = untag(final.entry_id)
        share(n).finish(dataclasses.replace(final, entry_id=entry))
    return shares


async def _each(calls: Iterable[Awaitable[Any]]) -> list[Any]:
    """Run the calls at once; their answers in order."""
    return list(await asyncio.gather(*calls))

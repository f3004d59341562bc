"""Every Redis key and channel name of the wire contract, in one place."""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import Literal

DEFAULT_PREFIX = "exlq"
CONSUMER_GROUP = "workers"
# Queue names and job ids end up inside key names and hash tags: keep them to a
# safe alphabet so that no name can break out of its `{...}` tag.
NAME_PATTERN = r"^[A-Za-z0-9._:-]{1,128}$"
_NAME_RE = re.compile(NAME_PATTERN)
# Priority lanes, highest first: each lane of a queue is a stream of its own, and a worker
# fills its free slots from the higher lane first (worker/lanes.py says how the lower one is
# never starved). A job's lane is the stream it was added to.
Lane = Literal["interactive", "batch"]
LANES: tuple[Lane, ...] = ("interactive", "batch")
# A job's hash names its entry as ``<entry id>`` in the interactive lane and ``<entry
# id>@<lane>`` in another, so that an entry is known by one string across the lanes' streams
# (two streams can hold the same id).
LANE_MARK = "@"
# A partition's hash tag is ``{<queue>/<n>}``: '/' is outside the names' alphabet, so no
# queue's own tag can be a partition's.
PARTITION_MARK = "/"


def entry_ref(entry_id: str, lane: Lane) -> str:
    """The name of stream entry ``entry_id`` of ``lane``, as job hashes and workers hold it."""
    return entry_id if lane == "interactive" else f"{entry_id}{LANE_MARK}{lane}"


def split_entry_ref(ref: str) -> tuple[str, Lane]:
    """The stream entry id and the lane of an entry's name (``entry_ref``'s inverse)."""
    entry_id, mark, lane = ref.partition(LANE_MARK)
    return (entry_id, "batch") if mark and lane == "batch" else (entry_id, "interactive")


def check_name(kind: str, value: str) -> str:
    """Return ``value`` if it is a valid queue name, prefix or job id, else raise ValueError."""
    if not isinstance(value, str) or not _NAME_RE.fullmatch(value):
        raise ValueError(
            f"{kind} {value!r} is not valid: use 1 to 128 characters from "
            "letters, digits, '.', '_', ':' and '-'"
        )
    return value


def events_channel(prefix: str, job_id: str) -> str:
    """The pub/sub channel that carries every event of one job."""
    return f"{prefix}:out:{{{job_id}}}"


def partition_of(job_id: str, partitions: int) -> int:
    """The partition of a queue split in ``partitions`` that holds job ``job_id``: CRC-32
    (zlib's, as every language has it) of the id's UTF-8 bytes, modulo the count. A job's
    id picks its partition, so that submits of one id meet in one partition (dedupe)."""
    return zlib.crc32(job_id.encode()) % partitions if partitions > 1 else 0


@dataclass(frozen=True)
class QueueKeys:
    """Key names of one queue, or of one partition of it. A queue's keys share the hash tag
    ``{queue}`` (one slot of a Redis Cluster); partition n > 0 of a split queue has its own,
    ``{queue/n}``, and partition 0 is the queue's own keys. The heartbeats, the cancel
    channel and the partition count are the queue's, whatever the partition."""

    queue: str
    prefix: str = DEFAULT_PREFIX
    partition: int = 0

    def __post_init__(self) -> None:
        check_name("queue name", self.queue)
        check_name("key prefix", self.prefix)
        if not isinstance(self.partition, int) or self.partition < 0:
            raise ValueError(f"partition {self.partition!r} is not valid: use 0 or more")

    def of_partition(self, partition: int) -> QueueKeys:
        """The keys of one partition of this queue."""
        return QueueKeys(self.queue, self.prefix, partition)

    @property
    def _queue_base(self) -> str:
        return f"{self.prefix}:{{{self.queue}}}"

    @property
    def _base(self) -> str:
        if self.partition:
            return f"{self.prefix}:{{{self.queue}{PARTITION_MARK}{self.partition}}}"
        return self._queue_base

    @property
    def partitions(self) -> str:
        """String holding how many partitions the queue is split in (absent: one)."""
        return f"{self._queue_base}:partitions"

    @property
    def base(self) -> str:
        """The prefix every key of the queue starts with, colon included."""
        return f"{self._base}:"

    @property
    def jobs(self) -> str:
        """Stream of job entries; field ``job`` holds the request JSON."""
        return f"{self._base}:jobs"

    def lane_jobs(self, lane: Lane) -> str:
        """The stream of one priority lane: ``jobs`` for interactive, ``jobs:batch`` for
        batch. Both have the consumer group ``workers``."""
        return self.jobs if lane == "interactive" else f"{self._base}:jobs:{lane}"

    @property
    def dead(self) -> str:
        """Stream of jobs that failed for good."""
        return f"{self._base}:dead"

    @property
    def workers(self) -> str:
        """Hash of worker heartbeats: consumer name -> JSON."""
        return f"{self._queue_base}:workers"

    @property
    def commits(self) -> str:
        """Hash of each worker's last write: consumer name -> the batch's name and what it
        reported, so that a batch sent again after a lost reply publishes nothing twice."""
        return f"{self._base}:commits"

    @property
    def cancel(self) -> str:
        """Pub/sub channel of cancellation requests (payload: a job id)."""
        return f"{self._queue_base}:cancel"

    def job(self, job_id: str) -> str:
        """Hash of one job's state, for dedupe, status and cancellation."""
        return f"{self._base}:job:{job_id}"

    def result(self, job_id: str) -> str:
        """String holding one job's final result JSON."""
        return f"{self._base}:result:{job_id}"

    def events(self, job_id: str) -> str:
        """The job's own pub/sub channel (wire version 1)."""
        return events_channel(self.prefix, job_id)

    def shard_events(self, job_id: str) -> str:
        """The job's channel in the queue's slot (wire version 2): sharded pub/sub
        (SSUBSCRIBE, SPUBLISH), which a Redis Cluster keeps on the queue's shard."""
        return f"{self._base}:out:{job_id}"

    def channel(self, job_id: str, version: int) -> str:
        """The channel a job's events go on, by its request's version."""
        return self.shard_events(job_id) if version >= 2 else self.events(job_id)

"""How many partitions a queue is split in: the one number its producers and workers share.

The count lives at ``P:{Q}:partitions`` (absent: 1, a queue of one partition). Workers set
it: a worker started with ``EXLQ_PARTITIONS`` above the stored count raises it, never
lowers it, and reads as many partitions as the count says. Producers read it and place each
job in partition ``partition_of(id, count)`` (keys.py), so the submits of one id meet in
one partition whichever producer sends them.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from exlq.protocol.keys import QueueKeys

log = logging.getLogger(__name__)

# The most partitions a queue may have: each is a stream (two, with the batch lane) and a
# consumer group that every worker reads.
MAX_PARTITIONS = 256

# Raise the count to ARGV[1] if it is lower (absent counts as 1); returns the count now.
RAISE_LUA = """
local now = tonumber(redis.call('GET', KEYS[1]) or '1') or 1
local wanted = tonumber(ARGV[1])
if wanted > now then
  redis.call('SET', KEYS[1], wanted)
  return wanted
end
return now
"""


def parse_count(raw: bytes | str | int | None) -> int:
    """The stored count, as a number of partitions from 1 to MAX_PARTITIONS; a value that is
    not one counts as 1, with a warning (someone wrote the key by hand)."""
    if raw is None:
        return 1
    text = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
    if text.isdigit() and 1 <= int(text) <= MAX_PARTITIONS:
        return int(text)
    log.warning(
        "the partition count %r is not a number from 1 to %d: the queue is read as one "
        "partition; set it with EXLQ_PARTITIONS on the workers",
        text,
        MAX_PARTITIONS,
    )
    return 1


async def raise_count(client: aioredis.Redis, keys: QueueKeys, wanted: int) -> int:
    """(Workers.) Raise the queue's count to ``wanted`` if it is lower; returns the count."""
    script = client.register_script(RAISE_LUA)
    return parse_count(await script(keys=[keys.partitions], args=[wanted]))


async def read_count(client: aioredis.Redis, keys: QueueKeys) -> int:
    """(Producers.) The queue's count. A user the ACL denies the key is taken to have one
    partition: its jobs then all go to partition 0, which every worker reads."""
    try:
        return parse_count(await client.get(keys.partitions))
    except NoPermissionError as exc:
        log.warning("cannot read %s (%s): submitting to partition 0", keys.partitions, exc)
        return 1

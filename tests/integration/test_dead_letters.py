"""`exlq dead` against a real Redis and worker: dead letters the worker wrote (a job that ran
out of attempts, an entry that is not JSON) are listed, shown, replayed to a run that ends
`done`, and purged."""

from __future__ import annotations

import asyncio
import inspect
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from typer.testing import CliRunner, Result

from exlq.cli import app
from exlq.protocol.keys import QueueKeys
from exlq.protocol.slot_routing import SlotClients

pytestmark = pytest.mark.integration

JOB = "dead-1"
REQUEST = json.dumps({"id": JOB, "prompt": "hello there", "max_new_tokens": 4})


def _runner() -> CliRunner:
    """A runner that keeps stderr apart: click before 8.2 (the SDK's floor runs 8.1) mixes
    it into stdout unless told not to; 8.2 and later always keep it apart."""
    separate: dict[str, Any] = {}
    if "mix_stderr" in inspect.signature(CliRunner.__init__).parameters:
        separate["mix_stderr"] = False
    return CliRunner(**separate)


async def _exlq(redis_url: str, *args: str, stdin: str | None = None) -> Result:
    """The `exlq` command, off the event loop: the worker under test runs on it."""
    runner = _runner()
    return await asyncio.to_thread(
        runner.invoke, app, [*args, "--redis-url", redis_url], input=stdin
    )


async def _wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.02)


async def _make_dead_letters(client: aioredis.Redis, keys: QueueKeys, start_worker: Any) -> None:
    """A batch-lane job whose earlier runs used up its attempts (its worker gives up on it:
    too_many_attempts), and an entry that is not JSON (refused: invalid_request)."""
    entry = await client.xadd(keys.lane_jobs("batch"), {"job": REQUEST})
    await client.hset(
        keys.job(JOB),
        mapping={"state": "running", "entry": f"{entry.decode()}@batch", "attempts": 3},
    )
    await client.xadd(keys.jobs, {"job": "not json at all"})
    await start_worker(max_attempts=3)

    async def two_dead() -> bool:
        return int(await client.xlen(keys.dead)) == 2

    await _wait_for(two_dead)


@pytest.mark.cluster_too
async def test_list_show_replay_purge(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await _make_dead_letters(redis_client, keys, start_worker)

    # One queue in this Redis: --queue may be left out.
    listed = await _exlq(redis_url, "dead", "list", "--json")
    assert listed.exit_code == 0, listed.output
    letters = json.loads(listed.stdout)
    assert [letter["id"] for letter in letters] == sorted(
        (letter["id"] for letter in letters),
        key=lambda i: tuple(map(int, i.split("-"))),
        reverse=True,
    )
    by_error = {letter["error"]: letter for letter in letters}
    assert set(by_error) == {"too_many_attempts", "invalid_request"}
    dead_job = by_error["too_many_attempts"]
    assert (dead_job["job_id"], dead_job["lane"], dead_job["attempts"]) == (JOB, "batch", 4)
    bad_id = by_error["invalid_request"]["id"]

    table = await _exlq(redis_url, "dead", "list", "--queue", queue_name)
    assert table.exit_code == 0, table.output
    assert JOB in table.stdout and "too_many_attempts" in table.stdout
    assert f"2 of 2 dead letters in queue {queue_name!r}" in table.stdout

    shown = await _exlq(redis_url, "dead", "show", JOB, "--queue", queue_name)
    assert shown.exit_code == 0, shown.output
    assert f"id: {dead_job['id']}" in shown.stdout
    assert "error: too_many_attempts" in shown.stdout
    assert '"prompt": "hello there"' in shown.stdout  # the request, pretty-printed

    # The replay keeps the id and the lane, starts at attempt 1, and the job runs to done.
    replayed = await _exlq(redis_url, "dead", "replay", JOB, "--queue", queue_name)
    assert replayed.exit_code == 0, replayed.output
    assert f"replayed job {JOB}: entry " in replayed.stdout
    assert f"in lane batch; events on {keys.events(JOB)}" in replayed.stdout

    async def done() -> bool:
        return await redis_client.hget(keys.job(JOB), "state") == b"done"

    await _wait_for(done)
    result = await _exlq(redis_url, "result", JOB, "--queue", queue_name)
    assert result.exit_code == 0, result.output
    stored = json.loads(result.stdout)
    assert (stored["state"], stored["attempts"]) == ("done", 1)
    assert stored["text"].startswith(" hello there")  # the echo engine's answer
    remaining = json.loads((await _exlq(redis_url, "dead", "list", "--json")).stdout)
    assert [letter["id"] for letter in remaining] == [bad_id]

    # A second replay of the same job finds no dead letter for it.
    again = await _exlq(redis_url, "dead", "replay", dead_job["id"], "--queue", queue_name)
    assert again.exit_code == 1
    assert "no dead letter" in again.stderr

    # A request that does not parse is reported and left in place.
    refused = await _exlq(redis_url, "dead", "replay", bad_id)
    assert refused.exit_code == 1
    assert f"not replayed: dead letter {bad_id}" in refused.stderr
    assert "does not parse" in refused.stderr
    assert int(await redis_client.xlen(keys.dead)) == 1

    # Purge asks first; no deletes one, and yes does.
    none_old = await _exlq(redis_url, "dead", "purge", "--older-than", "1h", "--yes")
    assert none_old.exit_code == 0 and "no dead letters older than 1h" in none_old.stdout
    kept = await _exlq(redis_url, "dead", "purge", stdin="n\n")
    assert kept.exit_code == 1
    assert "delete 1 dead letters" in kept.stdout
    assert int(await redis_client.xlen(keys.dead)) == 1
    purged = await _exlq(redis_url, "dead", "purge", stdin="y\n")
    assert purged.exit_code == 0, purged.output
    assert "deleted 1 dead letters" in purged.stdout
    assert int(await redis_client.xlen(keys.dead)) == 0


async def test_replay_refuses_a_job_that_runs_again(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await _make_dead_letters(redis_client, keys, start_worker)
    # The job was submitted again meanwhile, and waits: a replay would run it twice.
    await redis_client.hset(keys.job(JOB), mapping={"state": "queued", "entry": "9-0"})
    refused = await _exlq(redis_url, "dead", "replay", "--all", "--yes", "--queue", queue_name)
    assert refused.exit_code == 1, refused.output
    assert f"(job {JOB}): the job is queued again already (entry 9-0)" in refused.stderr
    assert "replayed job" not in refused.stdout
    assert int(await redis_client.xlen(keys.dead)) == 2


@pytest.mark.cluster_too
async def test_clear_errors_for_unknown_queues_ids_and_input(
    redis_url: str, queue_name: str, redis_client: aioredis.Redis
) -> None:
    keys = QueueKeys(queue_name)
    await redis_client.xadd(keys.dead, {"entry": "1-0", "job": REQUEST, "error": "engine_error"})
    nodes = SlotClients(redis_client)  # on a cluster, "other" lives on its own master
    await (await nodes.for_key("{other}")).xadd(QueueKeys("other").jobs, {"job": REQUEST})
    await nodes.aclose()
    several = await _exlq(redis_url, "dead", "list")
    assert several.exit_code == 1
    assert (
        f"say which queue with --queue (or EXLQ_QUEUE); queues: other, {queue_name}"
        in (several.stderr)
        or f"queues: {queue_name}, other" in several.stderr
    )
    unknown = await _exlq(redis_url, "dead", "list", "--queue", "nope")
    assert unknown.exit_code == 1 and "no queue 'nope'" in unknown.stderr
    missing = await _exlq(redis_url, "dead", "show", "no-such-job", "--queue", queue_name)
    assert missing.exit_code == 1 and "no dead letter 'no-such-job'" in missing.stderr
    bad_age = await _exlq(redis_url, "dead", "purge", "--older-than", "soon", "-q", queue_name)
    assert bad_age.exit_code == 1 and "duration 'soon' is not valid" in bad_age.stderr
    neither = await _exlq(redis_url, "dead", "replay", "-q", queue_name)
    assert neither.exit_code == 1 and "or give --all" in neither.stderr

"""exlq on a real Redis Cluster (3 masters, 3 replicas on loopback), found from an ordinary
URL of one node: queues land on different shards and each is served, and a failover of a
queue's master under load loses no job exlq was given."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import pytest
from redis.crc import key_slot

from bench.local_cluster import LocalCluster, Node
from exlq.producer import AsyncProducer, JobLost
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.echo.engine import echo_text
from tests.gateway_server import start_gateway
from tests.integration.test_openai_batch_app import (
    chat_line,
    file_lines,
    jsonl,
    upload,
    wait_for_status,
)

pytestmark = pytest.mark.integration
__all__ = ["start_gateway"]


def echo(prompt: str, tokens: int) -> str:
    return echo_text(GenerationRequest(prompt=prompt, max_new_tokens=tokens))


def queues_on_every_master(cluster: LocalCluster, prefix: str) -> dict[int, str]:
    """One queue name per master (by port), found by trying names until each has one."""
    masters = {node.port for node in cluster.masters_now()}
    chosen: dict[int, str] = {}
    for n in itertools.count():
        name = f"{prefix}{n}"
        owner = cluster.master_of(key_slot(QueueKeys(name).jobs.encode())).port
        chosen.setdefault(owner, name)
        if set(chosen) == masters:
            return chosen
    raise AssertionError("unreachable")


@pytest.fixture
def cluster(redis_cluster: LocalCluster) -> Any:
    redis_cluster.wait_healthy()
    yield redis_cluster
    redis_cluster.flush()


async def test_queues_on_different_shards_are_each_served(
    cluster: LocalCluster, start_worker: Any
) -> None:
    queues = queues_on_every_master(cluster, "shard")
    for queue in queues.values():
        await start_worker(redis_url=cluster.url, queue=queue)
    for port, queue in queues.items():
        async with AsyncProducer(cluster.url, queue=queue) as producer:
            results = await asyncio.gather(
                *[(await producer.submit(f"{queue} {i}", max_new_tokens=3)).result(timeout=10)
                  for i in range(5)]
            )  # fmt: skip
        assert [r.text for r in results] == [echo(f"{queue} {i}", 3) for i in range(5)]
        # The queue's keys are on its own master, and on no other.
        slot = key_slot(QueueKeys(queue).jobs.encode())
        holders = [
            node.port
            for node in cluster.masters_now()
            if node.client().execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)
        ]
        assert holders == [port]


async def test_a_failover_under_load_loses_no_job_exlq_was_given(
    cluster: LocalCluster, start_worker: Any
) -> None:
    """A master is killed while jobs stream; its replica takes over. Workers, producers
    and subscribers reconnect on their own. A job whose submit Redis acknowledged but lost
    in the asynchronous replication window is lost by Redis (the handle says JobLost);
    every other job ends, once."""
    queue = "failover"
    await start_worker(
        redis_url=cluster.url, queue=queue, echo_tokens_per_second=200.0, max_batch_size=16,
        claim_idle_ms=2000, heartbeat_seconds=0.5,
    )  # fmt: skip
    master: Node = cluster.master_of(key_slot(QueueKeys(queue).jobs.encode()))
    outcomes: dict[str, int] = {"done": 0, "lost_by_redis": 0, "lost_by_exlq": 0}
    duplicated = 0

    async def run(producer: AsyncProducer, i: int) -> None:
        nonlocal duplicated
        handle = await producer.submit(f"job {i}", max_new_tokens=20)
        try:
            dones = 0
            async with asyncio.timeout(60):
                async for event in handle.stream():
                    dones += event.type == "done"
            result = await handle.result(timeout=30)
        except JobLost:
            outcomes["lost_by_redis"] += 1
            return
        except TimeoutError:
            outcomes["lost_by_exlq"] += 1
            return
        duplicated += dones > 1
        assert result.text == echo(f"job {i}", 20)
        outcomes["done"] += 1

    jobs = 120
    try:
        async with AsyncProducer(cluster.url, queue=queue, wait_for_worker=True) as producer:
            tasks = []
            for i in range(jobs):
                tasks.append(asyncio.create_task(run(producer, i)))
                if i == jobs // 3:
                    cluster.kill(master)
                await asyncio.sleep(0.02)
            await asyncio.gather(*tasks)
    finally:
        if not master.alive:
            cluster.restart(master)  # back as a replica: the cluster whole for later tests
    new_master = cluster.master_of(key_slot(QueueKeys(queue).jobs.encode()))
    print(
        f"\njobs {jobs}, failovers 1 ({master.port} -> {new_master.port}), "
        f"lost by Redis {outcomes['lost_by_redis']}, lost by exlq {outcomes['lost_by_exlq']}, "
        f"duplicated {duplicated}"
    )
    assert new_master.port != master.port
    assert outcomes["lost_by_exlq"] == 0 and duplicated == 0
    assert outcomes["done"] + outcomes["lost_by_redis"] == jobs


async def test_the_openai_gateway_serves_chat_and_batches_on_a_cluster(
    cluster: LocalCluster, start_worker: Any, start_gateway: Any
) -> None:
    """Chat on queues of every master; a batch over all of them, its files and batch keys
    under the Batch API's own hash tag, on one master."""
    from openai import AsyncOpenAI

    queues = queues_on_every_master(cluster, "chat")
    for queue in queues.values():
        await start_worker(redis_url=cluster.url, queue=queue)
    server = start_gateway(redis_url=cluster.url)
    lines = [chat_line(f"req-{q}", q, f"{q} words", 3) for q in queues.values()]
    async with AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0) as client:
        for queue in queues.values():
            answer = await client.chat.completions.create(
                model=queue, messages=[{"role": "user", "content": "alpha beta"}], max_tokens=2
            )
            assert answer.choices[0].message.content == " alpha beta"
        listed = await client.models.list()
        assert sorted(m.id for m in listed.data) == sorted(queues.values())
        file_id = await upload(client, jsonl(lines))
        created = await client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = await wait_for_status(client, created.id, {"completed", "failed"})
        assert batch.status == "completed", batch.errors
        output = await file_lines(client, batch.output_file_id)
        assert [b.id for b in (await client.batches.list()).data] == [created.id]
    answers = {line["custom_id"]: line["response"]["body"] for line in output}
    for queue in queues.values():
        content = answers[f"req-{queue}"]["choices"][0]["message"]["content"]
        assert content == echo(f"{queue} words", 3)
    tag = "{openai-batch-api}"
    index = f"exlq:{tag}:batches"
    assert cluster.master_of(key_slot(index.encode())).client().zcard(index) == 1


async def test_events_go_on_the_queues_shard_and_a_v1_producer_still_hears_its_own(
    cluster: LocalCluster, start_worker: Any
) -> None:
    """On a cluster the SDK asks for wire version 2: the job's events on its queue's shard
    channel (SSUBSCRIBE), which no other shard carries. A producer of version 1 (an older
    SDK, redis-cli) adds its job as before and hears it on the job's own channel."""
    import json

    import redis.asyncio as aioredis

    queue = "sharded"
    await start_worker(redis_url=cluster.url, queue=queue)
    keys = QueueKeys(queue)
    master = cluster.master_of(key_slot(keys.jobs.encode()))
    async with AsyncProducer(cluster.url, queue=queue) as producer:
        result = await (await producer.submit("new sdk", max_new_tokens=2)).result(timeout=10)
        assert result.text == echo("new sdk", 2)
        stored = master.client().xrange(keys.jobs)
        assert json.loads(stored[-1][1][b"job"])["v"] == 2
    # Version 1, by hand: SUBSCRIBE to the job's own channel on any node, then XADD.
    other = next(node for node in cluster.masters_now() if node.port != master.port)
    listener = aioredis.Redis(host="127.0.0.1", port=other.port).pubsub()
    await listener.subscribe(keys.events("old-1"))
    request = {"v": 1, "id": "old-1", "prompt": "old sdk", "max_new_tokens": 2}
    master.client().xadd(keys.jobs, {"job": json.dumps(request)})
    kinds = []
    async with asyncio.timeout(10):
        while "done" not in kinds:
            message = await listener.get_message(ignore_subscribe_messages=True, timeout=1)
            if message is not None:
                kinds.append(json.loads(message["data"])["type"])
    await listener.aclose()
    assert kinds[-1] == "done" and "token" in kinds  # every event, on the v1 channel


class _NeverHealthy(LocalCluster):
    def wait_healthy(self, timeout_s: float = 30.0) -> None:
        raise TimeoutError("the cluster did not come up")


def test_a_cluster_that_fails_to_start_leaves_no_server_running(
    redis_cluster: LocalCluster,
) -> None:
    failing = _NeverHealthy(redis_cluster.binary, masters=1, replicas=1)
    with pytest.raises(TimeoutError), failing:
        pytest.fail("a cluster that never became healthy was entered")
    assert len(failing.nodes) == 2
    assert not any(node.alive for node in failing.nodes)
    assert failing._dir is not None and not Path(failing._dir.name).exists()

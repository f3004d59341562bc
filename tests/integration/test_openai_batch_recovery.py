"""A batch survives what happens to the replicas and the Redis under it: cancel and expiry
mid-run, a gateway stopped mid-batch, a replica that died holding the lease, and jobs
Redis lost. Each ends with every custom_id exactly once across the output and error
files."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
import redis.asyncio as aioredis

from exlq.producer.gateways.openai_api.batch_store import BatchKeys
from tests.integration.test_openai_batch_app import (
    Gateway,
    chat_line,
    deploy_bulk_limit,
    file_lines,
    jsonl,
    serve_gateway,
    upload,
    wait_for_status,
)

pytestmark = [
    pytest.mark.integration,
    pytest.mark.usefixtures("deploy_bulk_limit"),
]
__all__ = ["deploy_bulk_limit"]

# A slow worker: 20 tokens a second, two jobs at a time, so a batch runs for seconds.
SLOW = {"max_batch_size": 2, "echo_tokens_per_second": 20.0}


def _requests(model: str, count: int, max_tokens: int) -> list[dict[str, Any]]:
    return [chat_line(f"req-{i}", model, f"w{i} x{i}", max_tokens) for i in range(count)]


async def _start(gateway: Gateway, requests: list[dict[str, Any]]) -> str:
    file_id = await upload(gateway.client, jsonl(requests))
    created = await gateway.client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    return created.id


async def _wait_completed_at_least(gateway: Gateway, batch_id: str, count: int) -> None:
    async def enough() -> bool:
        batch = await gateway.client.batches.retrieve(batch_id)
        return batch.request_counts is not None and batch.request_counts.completed >= count

    await _until(enough)


async def _until(condition: Any, timeout_s: float = 30.0) -> None:
    async with asyncio.timeout(timeout_s):
        while not await condition():
            await asyncio.sleep(0.05)


async def _ended_lines(
    gateway: Gateway, batch: Any
) -> tuple[dict[str, dict[str, Any]], dict[str, dict[str, Any]]]:
    output = await file_lines(gateway.client, batch.output_file_id)
    errors = await file_lines(gateway.client, batch.error_file_id)
    every = [line["custom_id"] for line in output + errors]
    assert len(every) == len(set(every)), "a custom_id came back twice"
    return {line["custom_id"]: line for line in output}, {
        line["custom_id"]: line for line in errors
    }


async def test_a_cancelled_batch_keeps_what_finished_and_reports_the_rest(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(**SLOW)
    requests = _requests(queue_name, 12, 10)
    async with serve_gateway(redis_url) as gateway:
        batch_id = await _start(gateway, requests)
        await _wait_completed_at_least(gateway, batch_id, 2)
        cancelling = await gateway.client.batches.cancel(batch_id)
        assert cancelling.status in {"cancelling", "cancelled"} and cancelling.cancelling_at
        batch = await wait_for_status(gateway.client, batch_id, {"cancelled"})
        assert batch.cancelled_at
        again = await gateway.client.batches.cancel(batch_id)  # cancelling twice is harmless
        assert again.status == "cancelled"
        output, errors = await _ended_lines(gateway, batch)
    assert len(output) >= 2 and errors
    assert set(output) | set(errors) == {r["custom_id"] for r in requests}
    assert all(line["response"]["status_code"] == 200 for line in output.values())
    assert {line["error"]["code"] for line in errors.values()} == {"batch_cancelled"}
    assert all(line["response"] is None for line in errors.values())
    assert batch.request_counts is not None
    assert (batch.request_counts.total, batch.request_counts.completed) == (12, len(output))


async def test_a_batch_past_its_window_expires_with_batch_expired_lines(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(**SLOW)
    requests = _requests(queue_name, 12, 10)
    async with serve_gateway(redis_url, completion_window_s=2.0) as gateway:
        batch_id = await _start(gateway, requests)
        batch = await wait_for_status(gateway.client, batch_id, {"expired", "completed"})
        assert batch.status == "expired" and batch.expired_at
        assert batch.expires_at is not None and batch.expired_at >= batch.expires_at
        with pytest.raises(Exception, match="Cannot cancel"):
            await gateway.client.batches.cancel(batch_id)
        output, errors = await _ended_lines(gateway, batch)
    assert set(output) | set(errors) == {r["custom_id"] for r in requests}
    assert errors and {line["error"]["code"] for line in errors.values()} == {"batch_expired"}


async def test_a_gateway_stopped_mid_batch_leaves_it_to_the_next(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker(**SLOW)
    requests = _requests(queue_name, 12, 6)
    async with serve_gateway(redis_url) as first:
        batch_id = await _start(first, requests)
        await _wait_completed_at_least(first, batch_id, 2)
    async with serve_gateway(redis_url) as second:
        batch = await wait_for_status(second.client, batch_id, {"completed"})
        output, errors = await _ended_lines(second, batch)
    assert set(output) == {r["custom_id"] for r in requests} and not errors


async def test_a_dead_replicas_lease_lapses_and_another_finishes_the_batch(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    await start_worker(**SLOW)
    requests = _requests(queue_name, 10, 6)
    lease = ""
    async with serve_gateway(redis_url) as first:
        batch_id = await _start(first, requests)
        await _wait_completed_at_least(first, batch_id, 2)
        lease = BatchKeys("exlq").lease(batch_id)
        holder = await redis_client.get(lease)
    assert holder is not None
    # As if the first replica had died instead of stopping: its lease stays until it lapses.
    await redis_client.set(lease, holder, px=1000)
    async with serve_gateway(redis_url) as second:
        batch = await wait_for_status(second.client, batch_id, {"completed"})
        output, errors = await _ended_lines(second, batch)
    assert set(output) == {r["custom_id"] for r in requests} and not errors


async def test_jobs_redis_lost_are_submitted_again(
    redis_url: str, queue_name: str, start_worker: Any, redis_client: aioredis.Redis
) -> None:
    requests = _requests(queue_name, 5, 3)
    async with serve_gateway(redis_url) as gateway:
        batch_id = await _start(gateway, requests)
        pending = BatchKeys("exlq").pending(batch_id)

        async def all_submitted() -> bool:
            return int(await redis_client.hlen(pending)) == len(requests)

        await _until(all_submitted)
        # Redis loses the queue: its streams and every job's state.
        lost = [key async for key in redis_client.scan_iter(match=f"exlq:{{{queue_name}}}:*")]
        assert lost
        await redis_client.delete(*lost)
        await start_worker()
        batch = await wait_for_status(gateway.client, batch_id, {"completed"})
        output, errors = await _ended_lines(gateway, batch)
    assert set(output) == {r["custom_id"] for r in requests} and not errors

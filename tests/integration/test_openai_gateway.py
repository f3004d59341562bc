"""The OpenAI gateway through the real `openai` client: chat and completions, whole and
streamed, n choices, usage, stop strings, the model list; echo workers behind a real Redis.

The echo engine answers with the prompt's (or the last message's) words, cycled, one word
a token: "alpha beta" with max_tokens=4 gives " alpha beta alpha beta"."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI, NotFoundError, OpenAI

from exlq.protocol.keys import QueueKeys
from tests.gateway_server import GatewayServer, start_gateway

pytestmark = pytest.mark.integration
__all__ = ["start_gateway"]


def async_client(server: GatewayServer, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)


@pytest.mark.cluster_too
async def test_a_whole_chat_answer_through_the_sync_client(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()

    def ask() -> Any:
        with OpenAI(base_url=server.base_url, api_key="x", max_retries=0, timeout=30) as client:
            return client.chat.completions.create(
                model=queue_name,
                messages=[
                    {"role": "system", "content": "be brief"},
                    {"role": "user", "content": [{"type": "text", "text": "alpha beta"}]},
                ],
                max_tokens=4,
            )

    answer = await asyncio.to_thread(ask)
    assert answer.object == "chat.completion" and answer.id.startswith("chatcmpl-")
    assert answer.model == queue_name
    [choice] = answer.choices
    assert choice.index == 0
    assert choice.message.role == "assistant"
    assert choice.message.content == " alpha beta alpha beta"
    assert choice.finish_reason == "length"
    assert choice.logprobs is None
    usage = answer.usage
    assert usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens, usage.total_tokens) == (2, 4, 6)
    assert usage.prompt_tokens_details is not None
    assert usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.cluster_too
async def test_a_streamed_completion_through_the_async_client(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        stream = await client.completions.create(
            model=queue_name, prompt="one two three", max_tokens=5, stream=True
        )
        chunks = [chunk async for chunk in stream]
    assert all(c.object == "text_completion" and c.id == chunks[0].id for c in chunks)
    assert "".join(c.choices[0].text for c in chunks) == " one two three one two"
    assert [c.choices[0].finish_reason for c in chunks][-1] == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    assert all(c.usage is None for c in chunks)


async def test_a_streamed_chat_starts_with_the_role_and_ends_with_usage(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        stream = await client.chat.completions.create(
            model=queue_name,
            messages=[{"role": "user", "content": "red green"}],
            max_completion_tokens=3,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [chunk async for chunk in stream]
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    first, *middle, last = chunks
    assert first.choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in middle) == " red green red"
    assert middle[-1].choices[0].finish_reason == "length"
    assert last.choices == [] and last.usage is not None
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (2, 3)
    assert last.usage.total_tokens == 5
    assert all(c.usage is None for c in chunks[:-1])


async def test_n_choices_are_n_jobs_with_seeds_and_metadata(
    start_worker: Any, start_gateway: Any, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """n=3 with a seed: three jobs seeded 7, 8, 9, each a choice with its index, named
    after the response; metadata goes into each job."""
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        answer = await client.chat.completions.create(
            model=queue_name,
            messages=[{"role": "user", "content": "x y"}],
            max_tokens=2,
            n=3,
            seed=7,
            metadata={"team": "search"},
            user="someone",
        )
    assert [c.index for c in answer.choices] == [0, 1, 2]
    assert all(c.message.content == " x y" for c in answer.choices)
    assert answer.service_tier == "default"
    assert answer.usage is not None
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (2, 6)
    entries = await redis_client.xrange(QueueKeys(queue_name).jobs)
    jobs = sorted((json.loads(fields[b"job"]) for _, fields in entries), key=lambda j: j["id"])
    assert [job["id"] for job in jobs] == [f"{answer.id}-{i}" for i in range(3)]
    assert [job["sampling"]["seed"] for job in jobs] == [7, 8, 9]
    assert all(job["metadata"] == {"team": "search"} for job in jobs)


async def test_the_flex_tier_runs_on_the_batch_lane(
    start_worker: Any, start_gateway: Any, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """service_tier "flex" runs the job on the batch lane: answered like any other, its
    entry in the batch lane's stream, counted under that lane."""
    running = await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        answer = await client.chat.completions.create(
            model=queue_name,
            messages=[{"role": "user", "content": "slow lane"}],
            max_tokens=2,
            service_tier="flex",
        )
    assert answer.choices[0].message.content is not None
    assert answer.choices[0].message.content.split() == ["slow", "lane"]
    job_id = f"{answer.id}-0"
    entry = await redis_client.hget(QueueKeys(queue_name).job(job_id), "entry")
    assert entry is not None and entry.decode().endswith("@batch")
    received = running.metrics.registry.get_sample_value(
        "exlq_jobs_received_total", {"queue": queue_name, "lane": "batch"}
    )
    assert received == 1


async def test_n_streamed_choices_each_end_with_their_own_finish(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        stream = await client.completions.create(
            model=queue_name, prompt="p q", max_tokens=3, n=2, stream=True
        )
        texts = {0: "", 1: ""}
        finishes: dict[int, str | None] = {}
        async for chunk in stream:
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                if choice.finish_reason is not None:
                    finishes[choice.index] = choice.finish_reason
    assert texts == {0: " p q p", 1: " p q p"}
    assert finishes == {0: "length", 1: "length"}


async def test_a_stop_string_ends_the_text_before_it(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        whole = await client.completions.create(
            model=queue_name, prompt="a b c d", max_tokens=8, stop=[" c"]
        )
        stream = await client.chat.completions.create(
            model=queue_name,
            messages=[{"role": "user", "content": "a b c d"}],
            max_tokens=8,
            stop=" c",
            stream=True,
        )
        streamed = [chunk async for chunk in stream]
    assert (whole.choices[0].text, whole.choices[0].finish_reason) == (" a b", "stop")
    assert "".join(c.choices[0].delta.content or "" for c in streamed) == " a b"
    assert streamed[-1].choices[0].finish_reason == "stop"


async def test_a_prompt_of_token_ids_is_a_job_of_input_ids(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        answer = await client.completions.create(model=queue_name, prompt=[5, 6], max_tokens=2)
    # The echo engine names token ids t<id>.
    assert answer.choices[0].text == " t5 t6"


@pytest.mark.cluster_too
async def test_the_models_are_the_queues_live_workers_serve(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        listed = await client.models.list()
        model = await client.models.retrieve(queue_name)
        with pytest.raises(NotFoundError):
            await client.models.retrieve("no-such-model")
    assert [(m.id, m.object, m.owned_by) for m in listed.data] == [(queue_name, "model", "exlq")]
    assert model.id == queue_name and model.created > 0


async def test_health_and_readiness_need_no_key(start_gateway: Any) -> None:
    import httpx2

    server = start_gateway(api_keys="secret")
    root = server.base_url.removesuffix("/v1")
    async with httpx2.AsyncClient() as http:
        health = await http.get(f"{root}/healthz")
        ready = await http.get(f"{root}/readyz")
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    assert (ready.status_code, ready.json()) == (200, {"status": "ok"})

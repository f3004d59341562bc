"""What the Batch API's tests share: a gateway served by uvicorn on a free port, reached with
OpenAI's own client, and JSONL helpers. No tests here."""

from __future__ import annotations

import asyncio
import io
import json
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

import openai
import pytest
import redis
import uvicorn

from exlq.producer.gateways.openai_api.app import create_app
from exlq.producer.gateways.openai_api.batch_settings import BatchSettings
from exlq.producer.gateways.openai_api.settings import GatewaySettings
from tests.conftest import wait_until

# Fast pacing for tests: a step every 50 ms, small chunks so a batch takes several steps.
FAST = {"poll_interval_s": 0.05, "submit_chunk": 4, "read_chunk": 3, "lease_ms": 2000}


@dataclass
class Gateway:
    client: openai.AsyncOpenAI
    url: str


@asynccontextmanager
async def serve_gateway(redis_url: str, **batch_options: Any) -> AsyncIterator[Gateway]:
    """A gateway on a free port with its own runner; stopped (lifespan and all) on exit."""
    settings = GatewaySettings(redis_url=redis_url)
    app = create_app(settings, BatchSettings(**{**FAST, **batch_options}))
    server = uvicorn.Server(
        uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", lifespan="on")
    )
    task = asyncio.create_task(server.serve())
    await wait_until(lambda: server.started or task.done())
    port = server.servers[0].sockets[0].getsockname()[1]
    url = f"http://127.0.0.1:{port}/v1"
    client = openai.AsyncOpenAI(base_url=url, api_key="unused", max_retries=0)
    try:
        yield Gateway(client, url)
    finally:
        await client.close()
        server.should_exit = True
        await asyncio.wait_for(task, 30)


@pytest.fixture
def deploy_bulk_limit(redis_url: str) -> Iterator[None]:
    """The shipped redis.conf's proto-max-bulk-len (2 MB): no value the gateway writes may
    be larger. Restored after the test."""
    client = redis.Redis.from_url(redis_url)
    before = client.config_get("proto-max-bulk-len")["proto-max-bulk-len"]
    client.config_set("proto-max-bulk-len", "2mb")
    try:
        yield
    finally:
        client.config_set("proto-max-bulk-len", before)
        client.close()


def jsonl(lines: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


def chat_line(
    custom_id: str, model: str, words: str, max_tokens: int, **body: Any
) -> dict[str, Any]:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "model": model,
            "messages": [{"role": "user", "content": words}],
            "max_tokens": max_tokens,
            **body,
        },
    }


def echo(words: str, max_tokens: int) -> str:
    """What the echo engine answers: the prompt's words, cycled, each after a space."""
    split = words.split()
    return "".join(" " + split[i % len(split)] for i in range(max_tokens))


async def upload(client: openai.AsyncOpenAI, content: bytes, name: str = "in.jsonl") -> str:
    created = await client.files.create(file=(name, io.BytesIO(content)), purpose="batch")
    return created.id


async def file_lines(client: openai.AsyncOpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    content = await client.files.content(file_id)
    return [json.loads(line) for line in content.read().splitlines()]


async def wait_for_status(
    client: openai.AsyncOpenAI, batch_id: str, statuses: set[str], timeout_s: float = 30.0
) -> Any:
    async with asyncio.timeout(timeout_s):
        while True:
            batch = await client.batches.retrieve(batch_id)
            if batch.status in statuses:
                return batch
            await asyncio.sleep(0.05)

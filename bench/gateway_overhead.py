"""What each gateway adds to the time to first token over the SDK: sequential requests on
a fast echo worker, the clients taking turns request by request (so that a drift of the
machine touches them all alike), each client's p50 and p99, and its p50 and p99 less the
SDK's."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack
from typing import Any

import httpx2
import openai
from websockets.asyncio.client import connect

from bench.chat_streams import (
    chat_payload,
    httpx2_chat_ttft,
    openai_chat_ttft,
    raw_chat_ttft,
    sdk_ttft,
    websocket_ttft,
)
from bench.figures import latency_row
from bench.gateway_stack import GatewayStack
from exlq.producer.client import AsyncProducer

PROMPT = "the quick brown fox jumps over the lazy dog"
Timed = Callable[[], Awaitable[float]]
# The rows' order in the table, the SDK first: the others are compared with it.
CLIENTS = ("sdk", "openai-httpx2", "openai-raw-socket", "openai-client", "websocket")


async def _clients(stack: GatewayStack, exits: AsyncExitStack, max_tokens: int) -> dict[str, Timed]:
    producer = await exits.enter_async_context(AsyncProducer(stack.redis_url, queue=stack.queue))
    http = await exits.enter_async_context(
        httpx2.AsyncClient(base_url=stack.openai_url, timeout=60.0)
    )
    sdk = await exits.enter_async_context(
        openai.AsyncOpenAI(base_url=f"{stack.openai_url}/v1", api_key="unused", max_retries=0)
    )
    ws = await exits.enter_async_context(connect(stack.websocket_url))
    payload = chat_payload(stack.queue, PROMPT, max_tokens)
    counter = iter(range(1 << 62))
    return {
        "sdk": lambda: sdk_ttft(producer, PROMPT, max_tokens),
        "openai-httpx2": lambda: httpx2_chat_ttft(http, payload),
        "openai-raw-socket": lambda: raw_chat_ttft("127.0.0.1", stack.openai_port, payload),
        "openai-client": lambda: openai_chat_ttft(sdk, stack.queue, PROMPT, max_tokens),
        "websocket": lambda: websocket_ttft(ws, f"r{next(counter)}", PROMPT, max_tokens),
    }


async def measure_overhead(
    stack: GatewayStack, requests: int, warmup: int, max_tokens: int
) -> dict[str, Any]:
    """``requests`` timed requests per client after ``warmup`` untimed ones, in turns."""
    async with AsyncExitStack() as exits:
        clients = await _clients(stack, exits, max_tokens)
        for _ in range(warmup):
            for timed in clients.values():
                await timed()
        samples: dict[str, list[float]] = {name: [] for name in clients}
        names = list(clients)
        started = time.monotonic()
        for turn in range(requests):
            # Each turn starts with another client: no client always follows the same one.
            order = names[turn % len(names) :] + names[: turn % len(names)]
            for name in order:
                samples[name].append(await clients[name]())
        wall_s = time.monotonic() - started
    rows = {name: latency_row(samples[name]) for name in CLIENTS}
    base = rows["sdk"]
    for row in rows.values():
        row["added_p50_ms"] = row["p50_ms"] - base["p50_ms"]
        row["added_p99_ms"] = row["p99_ms"] - base["p99_ms"]
    return {
        "requests_per_client": requests,
        "warmup_per_client": warmup,
        "max_tokens": max_tokens,
        "wall_s": wall_s,
        "clients": rows,
    }

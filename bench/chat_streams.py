"""One streamed generation through each client a benchmark compares, timed from the
request's send to its first text, and read to its end, which is checked: every chunk the
job makes, then its end (a finish reason and ``[DONE]``, or exllamav2's full message).

- the SDK: ``AsyncProducer.submit`` then ``JobHandle.stream()``, to the first TokenEvent
  with text;
- the OpenAI gateway's streaming chat through a raw HTTP client (httpx2, openai's
  transport; or bench.raw_sse's socket reader), to the first ``data:`` chunk with content;
  and through the ``openai`` client;
- the WebSocket gateway: an ``infer`` with ``stream: true``, to the first chunk message.
"""

from __future__ import annotations

import contextlib
import json
import time
from dataclasses import dataclass
from typing import Any

import httpx2
import openai
from websockets.asyncio.client import ClientConnection

from bench.raw_sse import sse_data
from exlq.producer.client import AsyncProducer
from exlq.protocol.models import DoneEvent, ErrorEvent, TokenEvent

DONE = "[DONE]"
CHAT_PATH = "/v1/chat/completions"


class StreamFailed(RuntimeError):
    """A stream that answered an error, or ended without all its chunks or its end."""


def chat_payload(model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": max_tokens,
        "stream": True,
    }


@dataclass
class StreamCheck:
    """Counts one stream's text chunks and notes its first one and its end."""

    expected_chunks: int
    sent_at: float
    first_text_at: float | None = None
    text_chunks: int = 0
    ended: bool = False
    finish_reason: str | None = None

    def text(self) -> None:
        if self.first_text_at is None:
            self.first_text_at = time.perf_counter()
        self.text_chunks += 1

    def ttft_s(self) -> float:
        """The time to first text of a stream that came whole; raises StreamFailed else."""
        if not self.ended or self.text_chunks != self.expected_chunks:
            raise StreamFailed(
                f"stream ended={self.ended} after {self.text_chunks} of "
                f"{self.expected_chunks} chunks (finish_reason {self.finish_reason})"
            )
        assert self.first_text_at is not None
        return self.first_text_at - self.sent_at


def read_chat_data(check: StreamCheck, data: str) -> None:
    """One ``data:`` payload of a streamed chat completion."""
    if data == DONE:
        if check.finish_reason != "length":
            raise StreamFailed(f"[DONE] after finish_reason {check.finish_reason!r}")
        check.ended = True
        return
    body = json.loads(data)
    if "error" in body:
        raise StreamFailed(f"error event: {body['error']}")
    for choice in body["choices"]:
        if choice.get("delta", {}).get("content"):
            check.text()
        check.finish_reason = choice.get("finish_reason") or check.finish_reason


async def sdk_ttft(producer: AsyncProducer, prompt: str, max_tokens: int) -> float:
    check = StreamCheck(max_tokens, time.perf_counter())
    handle = await producer.submit(
        messages=[{"role": "user", "content": prompt}], max_new_tokens=max_tokens
    )
    async for event in handle.stream():
        if isinstance(event, TokenEvent) and event.text:
            check.text()
        elif isinstance(event, ErrorEvent):
            raise StreamFailed(f"error event: {event.error}")
        elif isinstance(event, DoneEvent):
            check.finish_reason = event.finish_reason
            check.ended = True
    return check.ttft_s()


async def raw_chat_ttft(host: str, port: int, payload: dict[str, Any]) -> float:
    """A new connection per request (Connection: close), as bench.raw_sse makes them."""
    check = StreamCheck(payload["max_tokens"], time.perf_counter())
    async with contextlib.aclosing(sse_data(host, port, CHAT_PATH, payload)) as stream:
        async for data in stream:
            read_chat_data(check, data)
    return check.ttft_s()


async def httpx2_chat_ttft(client: httpx2.AsyncClient, payload: dict[str, Any]) -> float:
    """Through a kept-alive connection of ``client`` (base_url: the gateway)."""
    check = StreamCheck(payload["max_tokens"], time.perf_counter())
    async with client.stream("POST", CHAT_PATH, json=payload) as response:
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            raise StreamFailed(f"HTTP {response.status_code}: {body[:300]}")
        async for line in response.aiter_lines():
            if line.startswith("data:"):
                read_chat_data(check, line[5:].strip())
    return check.ttft_s()


async def openai_chat_ttft(
    client: openai.AsyncOpenAI, model: str, prompt: str, max_tokens: int
) -> float:
    check = StreamCheck(max_tokens, time.perf_counter())
    stream = await client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        stream=True,
    )
    async with stream:
        async for chunk in stream:
            for choice in chunk.choices:
                if choice.delta.content:
                    check.text()
                check.finish_reason = choice.finish_reason or check.finish_reason
    check.ended = check.finish_reason == "length"
    return check.ttft_s()


def infer_message(request_id: str, prompt: str, max_new_tokens: int) -> dict[str, Any]:
    return {
        "action": "infer",
        "request_id": request_id,
        "text": prompt,
        "max_new_tokens": max_new_tokens,
        "stream": True,
    }


def read_infer_reply(check: StreamCheck, message: dict[str, Any]) -> None:
    """One reply to an infer: a chunk, the full message, or an error."""
    kind = message.get("response_type")
    if kind == "chunk":
        check.text()
    elif kind == "full":
        check.finish_reason = message.get("stop_reason")
        check.ended = check.finish_reason == "num_tokens"
    else:
        raise StreamFailed(f"infer answered {message}")


async def websocket_ttft(
    connection: ClientConnection, request_id: str, prompt: str, max_tokens: int
) -> float:
    """One infer at a time on ``connection``: every reply is this infer's."""
    check = StreamCheck(max_tokens, time.perf_counter())
    await connection.send(json.dumps(infer_message(request_id, prompt, max_tokens)))
    while not check.ended:
        read_infer_reply(check, json.loads(await connection.recv()))
        if check.finish_reason is not None and not check.ended:
            break
    return check.ttft_s()

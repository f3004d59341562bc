"""A cheap streaming HTTP/1.1 client on asyncio's streams: one POST per connection, its
server-sent events' ``data`` fields as they arrive. For opening thousands of streams from a
process that shares the CPUs with the gateway it measures: no client library's per-stream
cost (httpx2's or openai's) beyond reading bytes and splitting lines.

It reads what uvicorn and sse-starlette send (a chunked body, or one up to the close); it
is not a general HTTP client."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any


class HttpError(RuntimeError):
    """An answer other than 200; the message holds the status and the body."""

    def __init__(self, status: int, body: str) -> None:
        super().__init__(f"HTTP {status}: {body[:500]}")
        self.status = status


def _request(host: str, port: int, path: str, body: bytes) -> bytes:
    head = (
        f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Accept: text/event-stream\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


async def _read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    status_line = await reader.readline()
    if not status_line:
        raise ConnectionError("the server closed the connection before answering")
    status = int(status_line.split()[1])
    headers: dict[str, str] = {}
    while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    return status, headers


async def _chunks(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[bytes]:
    """The body's pieces: de-chunked, or as read until the server closes."""
    if not chunked:
        while piece := await reader.read(65536):
            yield piece
        return
    while True:
        size = int((await reader.readline()).split(b";")[0], 16)
        if size == 0:
            return
        piece = await reader.readexactly(size + 2)  # the piece and its CRLF
        yield piece[:-2]


async def _lines(reader: asyncio.StreamReader, chunked: bool) -> AsyncIterator[str]:
    pending = b""
    async for piece in _chunks(reader, chunked):
        pending += piece
        *complete, pending = pending.split(b"\n")
        for line in complete:
            yield line.rstrip(b"\r").decode()


async def sse_data(
    host: str, port: int, path: str, payload: dict[str, Any]
) -> AsyncGenerator[str, None]:
    """POST ``payload`` as JSON and yield each event's ``data`` as it arrives. Raises
    HttpError for a status other than 200. Use it inside contextlib.aclosing, so that the
    connection closes where the reader stops early."""
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(_request(host, port, path, json.dumps(payload).encode()))
        status, headers = await _read_head(reader)
        chunked = headers.get("transfer-encoding", "").lower() == "chunked"
        if status != 200:
            body = b"".join([piece async for piece in _chunks(reader, chunked)])
            raise HttpError(status, body.decode(errors="replace"))
        async for line in _lines(reader, chunked):
            if line.startswith("data:"):
                yield line[5:].strip()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()

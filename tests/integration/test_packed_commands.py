"""On a real Redis, the producer's connections and the worker's pack every command in C,
and a job with text beyond ASCII goes through whole."""

from __future__ import annotations

from typing import Any

import pytest

from exlq.producer import AsyncProducer
from exlq.protocol import command_packing

pytestmark = pytest.mark.integration


class _CountingPacker:
    """Stands in for hiredis's packer, counting the commands it packs."""

    def __init__(self, packer: Any) -> None:
        self.packer = packer
        self.commands: list[bytes] = []

    def pack(self, *args: Any) -> list[bytes]:
        name = args[0]
        self.commands.append(name.encode() if isinstance(name, str) else bytes(name))
        return list(self.packer.pack(*args))


async def test_the_sdk_and_the_worker_pack_their_commands_in_c(
    redis_url: str, queue_name: str, start_worker: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    packer = _CountingPacker(command_packing._PACKER)
    monkeypatch.setattr(command_packing, "_PACKER", packer)
    running = await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("café 漢字 ✓", max_new_tokens=3)
        result = await handle.result(timeout=10)
        assert await producer.get_result(handle.id) == result  # a command on the SDK's pool
    assert result.text == " café 漢字 ✓"
    await running.shutdown()
    sent = {name.upper() for name in packer.commands}
    # The SDK's one write (the subscription and its submit script), the worker's read, its
    # start script and its commit, and the SDK's read of the stored result.
    assert {b"SUBSCRIBE", b"EVALSHA", b"XREADGROUP", b"GET"} <= sent, sent

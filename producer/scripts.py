"""Run one Lua script for many jobs in one pipeline of EVALSHA (SDK and workers).

redis-py's own way (a registered script called with ``client=pipeline``) checks SCRIPT
EXISTS before every pipeline: one more round trip each time. Here the pipeline sends
EVALSHA alone; where Redis lost the script (a restart, SCRIPT FLUSH) it answers NOSCRIPT
without running anything, and those calls run again after a SCRIPT LOAD.
"""

from __future__ import annotations

from collections.abc import Sequence

import redis.asyncio as aioredis
from redis.commands.core import AsyncScript
from redis.exceptions import NoScriptError

ScriptCall = tuple[Sequence[str], Sequence[str | int | float]]  # (keys, args)


async def run_many(
    client: aioredis.Redis, script: AsyncScript, calls: Sequence[ScriptCall]
) -> list[object]:
    """The reply of each call, in order: a value, or the exception Redis answered with
    (raise_on_error=False); connection errors raise."""
    replies: list[object] = [None] * len(calls)
    todo = list(range(len(calls)))
    for _ in range(2):
        pipe = client.pipeline(transaction=False)
        for i in todo:
            keys, args = calls[i]
            pipe.evalsha(script.sha, len(keys), *keys, *args)
        results = await pipe.execute(raise_on_error=False)
        for i, result in zip(todo, results, strict=True):
            replies[i] = result
        todo = [i for i in todo if isinstance(replies[i], NoScriptError)]
        if not todo:
            break
        await client.script_load(script.script)
    return replies

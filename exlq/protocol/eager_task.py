"""eager_task: a task that runs at once, up to its first real wait.

A task made with ``asyncio.create_task`` first runs on the loop's next pass, after the
code that made it has yielded. Where that code goes on with CPU work (validating the rest
of a burst, parsing the entries a read brought), a command the task would send waits for
that work. Started eagerly, the task writes its command now, and Redis answers while the
CPU work goes on. Python 3.12 added eager tasks; before it the task is a plain one, and
started_task() lets one pass of the loop run it.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Coroutine
from typing import Any, TypeVar

T = TypeVar("T")

# Whether eager_task() runs its coroutine at once (Python >= 3.12).
EAGER_START = sys.version_info >= (3, 12)


def eager_task(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task for ``coro``, run now up to its first real wait where Python can (3.12 and
    later); on earlier Pythons it starts on the loop's next pass."""
    if sys.version_info >= (3, 12):
        loop = asyncio.get_running_loop()
        return asyncio.Task(coro, loop=loop, name=name, eager_start=True)
    return asyncio.create_task(coro, name=name)


async def started_task(coro: Coroutine[Any, Any, T], name: str) -> asyncio.Task[T]:
    """A task for ``coro`` that has run up to its first real wait when this returns: eager
    where Python can, else after one pass of the loop (which runs other ready tasks too)."""
    task = eager_task(coro, name)
    if not EAGER_START:
        await asyncio.sleep(0)
    return task

"""QuietWait: a stream's next event, or None after a quiet period, with one timer a queue."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from exlq.producer.quiet_wait import QuietWait


async def test_an_event_waiting_in_the_queue_comes_at_once() -> None:
    events: asyncio.Queue[bytes] = asyncio.Queue()
    events.put_nowait(b'{"seq": 0}')
    assert await QuietWait(events).next(10.0) == b'{"seq": 0}'


async def test_a_quiet_queue_ends_the_wait_with_none() -> None:
    events: asyncio.Queue[bytes] = asyncio.Queue()
    wait = QuietWait(events)
    loop = asyncio.get_running_loop()
    began = loop.time()
    assert await wait.next(0.05) is None
    assert loop.time() - began >= 0.05
    assert events.empty()  # the marker was taken, nothing is left behind
    # An event after the quiet spell comes as usual, and a second quiet spell ends too.
    events.put_nowait(b'{"seq": 1}')
    assert await wait.next(0.05) == b'{"seq": 1}'
    assert await wait.next(0.05) is None


async def test_events_that_keep_coming_set_one_timer_and_never_end_the_wait(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: asyncio.Queue[bytes] = asyncio.Queue()
    wait = QuietWait(events)
    loop = asyncio.get_running_loop()
    timers: list[float] = []
    call_at = loop.call_at

    def counting_call_at(when: float, callback: Any, *args: Any, **kw: Any) -> asyncio.TimerHandle:
        if getattr(callback, "__self__", None) is wait:  # the wait's own timers
            timers.append(when)
        return call_at(when, callback, *args, **kw)

    monkeypatch.setattr(loop, "call_at", counting_call_at)

    async def publish() -> None:
        for seq in range(20):
            await asyncio.sleep(0.002)
            events.put_nowait(b'{"seq": %d}' % seq)

    publisher = asyncio.create_task(publish())
    got = [await wait.next(0.2) for _ in range(20)]
    await publisher
    assert got == [b'{"seq": %d}' % seq for seq in range(20)]
    assert len(timers) == 1  # an asyncio.timeout per wait would have set 20
    wait.close()


async def test_a_wait_that_began_after_the_timer_was_set_gets_its_full_quiet_period() -> None:
    events: asyncio.Queue[bytes] = asyncio.Queue()
    wait = QuietWait(events)
    loop = asyncio.get_running_loop()
    loop.call_later(0.06, events.put_nowait, b'{"seq": 0}')
    assert await wait.next(0.1) == b'{"seq": 0}'  # the timer runs on, due at 0.1
    began = loop.time()
    assert await wait.next(0.1) is None
    assert loop.time() - began >= 0.1  # moved to this wait's deadline, not the first's


async def test_close_stops_the_timer() -> None:
    events: asyncio.Queue[bytes] = asyncio.Queue()
    wait = QuietWait(events)
    asyncio.get_running_loop().call_later(0.01, events.put_nowait, b"{}")
    assert await wait.next(0.05) == b"{}"
    wait.close()
    await asyncio.sleep(0.08)
    assert events.empty()  # no marker came after the stream ended

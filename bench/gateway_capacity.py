"""How many concurrent streams one gateway process holds: N streaming requests opened at
once, each a long, slow echo job, so that all are open together; every stream must bring
all its chunks and its end. The gateway's CPU and RSS (psutil) are sampled meanwhile.

The client runs in this process, on the same CPUs as the gateway, the workers and Redis:
it reads with bench.raw_sse (HTTP) and one websockets connection per group of infers,
and reports its own CPU time, so that its share of the machine is known."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import psutil  # type: ignore[import-untyped]
from websockets.asyncio.client import connect

from bench.chat_streams import (
    CHAT_PATH,
    StreamCheck,
    chat_payload,
    infer_message,
    read_chat_data,
    read_infer_reply,
)
from bench.raw_sse import sse_data

PROMPT = "one two three four five six seven eight"
# The most errors a run keeps the text of (the count is always whole).
KEPT_ERRORS = 5


@dataclass
class Tally:
    """The streams of one run: how many are open, the most open at once, how they ended."""

    streams: int
    open_now: int = 0
    peak_open: int = 0
    receiving_now: int = 0
    peak_receiving: int = 0
    completed: int = 0
    errors: int = 0
    error_samples: list[str] = field(default_factory=list)

    def opened(self) -> None:
        self.open_now += 1
        self.peak_open = max(self.peak_open, self.open_now)

    def first_text(self) -> None:
        self.receiving_now += 1
        self.peak_receiving = max(self.peak_receiving, self.receiving_now)

    def closed(self, check: StreamCheck, failure: BaseException | None) -> None:
        self.open_now -= 1
        if check.first_text_at is not None:
            self.receiving_now -= 1
        if failure is None:
            try:
                check.ttft_s()
            except Exception as exc:  # a stream cut short
                failure = exc
        if failure is None:
            self.completed += 1
            return
        self.errors += 1
        if len(self.error_samples) < KEPT_ERRORS:
            self.error_samples.append(f"{type(failure).__name__}: {failure}")


class _CountedCheck(StreamCheck):
    """A StreamCheck that tells the tally when its stream starts to receive."""

    def __init__(self, expected_chunks: int, tally: Tally) -> None:
        super().__init__(expected_chunks, time.perf_counter())
        self._tally = tally

    def text(self) -> None:
        if self.first_text_at is None:
            self._tally.first_text()
        super().text()


async def _http_stream(port: int, payload: dict[str, Any], tally: Tally) -> None:
    check = _CountedCheck(payload["max_tokens"], tally)
    tally.opened()
    failure: BaseException | None = None
    try:
        async with contextlib.aclosing(sse_data("127.0.0.1", port, CHAT_PATH, payload)) as data:
            async for piece in data:
                read_chat_data(check, piece)
    except Exception as exc:  # counted, not raised: one stream's failure is a figure
        failure = exc
    finally:
        tally.closed(check, failure)


async def openai_streams(port: int, model: str, n: int, max_tokens: int, tally: Tally) -> None:
    payload = chat_payload(model, PROMPT, max_tokens)
    await asyncio.gather(*(_http_stream(port, payload, tally) for _ in range(n)))


async def _websocket_group(
    url: str, first_id: int, count: int, max_tokens: int, tally: Tally
) -> None:
    """``count`` infers on one connection, answered by request_id."""
    checks = {f"r{first_id + i}": _CountedCheck(max_tokens, tally) for i in range(count)}
    for _ in checks:
        tally.opened()
    failure: BaseException | None = None
    try:
        async with connect(url, max_queue=None) as ws:
            for request_id in checks:
                await ws.send(json.dumps(infer_message(request_id, PROMPT, max_tokens)))
            ended = 0
            while ended < count:
                message = json.loads(await ws.recv())
                check = checks[message["request_id"]]
                read_infer_reply(check, message)
                ended += message.get("response_type") == "full"
    except Exception as exc:  # the connection's failure fails each of its infers
        failure = exc
    finally:
        for check in checks.values():
            tally.closed(check, failure)


async def websocket_streams(
    url: str, n: int, per_connection: int, max_tokens: int, tally: Tally
) -> None:
    groups = [
        _websocket_group(url, start, min(per_connection, n - start), max_tokens, tally)
        for start in range(0, n, per_connection)
    ]
    await asyncio.gather(*groups)


class ProcessWatch:
    """A process's CPU time and its largest RSS over a run, sampled every ``every_s``."""

    def __init__(self, pid: int, every_s: float = 0.5) -> None:
        self._process = psutil.Process(pid)
        self._every_s = every_s
        self.peak_rss = 0
        self.peak_cpu_percent = 0.0

    async def __aenter__(self) -> ProcessWatch:
        self._cpu0 = sum(self._process.cpu_times()[:2])
        self._wall0 = time.monotonic()
        self._process.cpu_percent(None)
        self._task = asyncio.create_task(self._sample())
        return self

    async def _sample(self) -> None:
        while True:
            await asyncio.sleep(self._every_s)
            self._take_sample()

    def _take_sample(self) -> None:
        self.peak_rss = max(self.peak_rss, self._process.memory_info().rss)
        self.peak_cpu_percent = max(self.peak_cpu_percent, self._process.cpu_percent(None))

    async def __aexit__(self, *exc: object) -> None:
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._take_sample()  # a run shorter than one interval still has its figures
        self.cpu_s = sum(self._process.cpu_times()[:2]) - self._cpu0
        self.wall_s = time.monotonic() - self._wall0

    def figures(self) -> dict[str, float]:
        return {
            "cpu_s": self.cpu_s,
            "cpu_percent_mean": 100 * self.cpu_s / self.wall_s,
            "cpu_percent_peak": self.peak_cpu_percent,
            "rss_mib_peak": self.peak_rss / 2**20,
        }


async def run_streams(
    open_streams: Callable[[Tally], Awaitable[None]],
    n: int,
    gateway_pid: int,
    timeout_s: float,
) -> dict[str, Any]:
    """One run of ``n`` streams; the tally, the gateway's figures and the client's CPU."""
    tally = Tally(n)
    client_cpu0 = time.process_time()
    async with ProcessWatch(gateway_pid) as gateway:
        try:
            async with asyncio.timeout(timeout_s):
                await open_streams(tally)
        except TimeoutError:
            pass  # the streams still open were closed by their cancellation: errors
    return {
        "streams": n,
        "completed": tally.completed,
        "errors": tally.errors,
        "error_samples": tally.error_samples,
        "peak_open": tally.peak_open,
        "peak_receiving": tally.peak_receiving,
        "wall_s": gateway.wall_s,
        "gateway": gateway.figures(),
        "client_cpu_s": time.process_time() - client_cpu0,
    }

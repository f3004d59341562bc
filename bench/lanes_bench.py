"""Batch vs interactive: interactive requests' time to first token while a Batch API batch
runs on the batch lane of the same queue, against the same requests on an idle queue.

One echo worker (``--slots``) and the OpenAI gateway, real processes (bench.gateway_stack).
A batch of ``--batch-requests`` chat requests is uploaded through the gateway's /v1/files
and created through /v1/batches (the ``openai`` client); once its first requests complete,
interactive requests (streaming chat through the gateway, read with httpx2) run one after
another until ``--interactive`` are timed or the batch nears its end (fewer requests left
than twice the worker's slots: the worker is no longer full). The batch is then polled to
its end: its completed count, its duration from create to completed, its throughput.

Twice: with the worker's default lane settings (EXLQ_BATCH_MIN_SLOTS 1, an interactive
reserve of an eighth of the slots) and with EXLQ_INTERACTIVE_RESERVED_SLOTS=0, to show what
the reserve buys. (The lane settings have no CLI flags; the worker reads them from the
environment.)

    python -m bench.lanes_bench --batch-requests 2000 --batch-tokens 40 --slots 32
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import time
from dataclasses import dataclass, field
from typing import Any

import httpx2
import openai

from bench.chat_streams import chat_payload, httpx2_chat_ttft, sdk_ttft
from bench.figures import latency_row, print_table, write_summary
from bench.gateway_stack import EchoWorker, GatewayStack
from bench.sdk_path import RESULTS
from exlq.producer.client import AsyncProducer

QUEUE = "lanes-bench"
PROMPT = "alpha beta gamma delta epsilon zeta eta theta"
TERMINAL = {"completed", "failed", "expired", "cancelled"}
POLL_S = 0.25
# The reserve settings compared: a name and the worker's environment.
RESERVES: dict[str, dict[str, str]] = {
    "default": {},
    "0": {"EXLQ_INTERACTIVE_RESERVED_SLOTS": "0"},
}


def batch_file(model: str, requests: int, max_tokens: int) -> bytes:
    lines = (
        {
            "custom_id": f"req-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": model,
                "messages": [{"role": "user", "content": PROMPT}],
                # From half to one and a half times ``max_tokens``: jobs of one length
                # would start and end together, freeing slots in waves.
                "max_tokens": max_tokens // 2 + (i * 7919) % (max_tokens + 1),
            },
        }
        for i in range(requests)
    )
    return b"".join(json.dumps(line).encode() + b"\n" for line in lines)


@dataclass
class BatchWatch:
    """A batch's progress, polled: its last Batch object and when it reached an end."""

    client: openai.AsyncOpenAI
    batch_id: str
    created_at: float
    status: str = "validating"
    total: int = 0
    completed: int = 0
    failed: int = 0
    ended_at: float | None = None
    # Set once the batch runs (its first request completed) or ended.
    running: asyncio.Event = field(default_factory=asyncio.Event)

    async def poll(self) -> None:
        while self.ended_at is None:
            batch = await self.client.batches.retrieve(self.batch_id)
            self.status = batch.status
            counts = batch.request_counts
            if counts is not None:
                self.total, self.completed, self.failed = (
                    counts.total,
                    counts.completed,
                    counts.failed,
                )
            if self.status in TERMINAL:
                self.ended_at = time.monotonic()
            if self.completed or self.ended_at is not None:
                self.running.set()
            else:
                await asyncio.sleep(POLL_S)

    def saturating(self, slots: int) -> bool:
        """Enough of the batch is left to keep every slot busy (the counts lag a runner
        step, so twice the slots)."""
        return self.ended_at is None and self.total - self.completed - self.failed > 2 * slots

    def figures(self) -> dict[str, Any]:
        duration = (self.ended_at or time.monotonic()) - self.created_at
        return {
            "status": self.status,
            "total": self.total,
            "completed": self.completed,
            "failed": self.failed,
            "duration_s": duration,
            "requests_per_s": self.completed / duration if duration else 0.0,
        }


class Interactive:
    """The interactive requests, two clients in turns: streaming chat through the gateway
    (httpx2) and the SDK straight to Redis. The SDK's figure is the worker's lanes alone;
    the gateway's adds the gateway process, which also runs the batch. A random pause
    (up to ``gap_ms``) before each request, so that sequential requests do not fall in
    step with the batch's jobs."""

    CLIENTS = ("gateway", "sdk")

    def __init__(
        self, http: httpx2.AsyncClient, producer: AsyncProducer, args: argparse.Namespace
    ) -> None:
        self._http = http
        self._producer = producer
        self._payload = chat_payload(QUEUE, PROMPT, args.interactive_tokens)
        self._tokens = args.interactive_tokens
        self._gap_s = args.gap_ms / 1000
        self._random = random.Random(args.seed)
        self.samples: dict[str, list[float]] = {name: [] for name in self.CLIENTS}

    async def turn(self) -> None:
        """One request per client, in an order that alternates."""
        order = self.CLIENTS if self.count() % 2 == 0 else self.CLIENTS[::-1]
        for name in order:
            await asyncio.sleep(self._random.uniform(0, self._gap_s))
            self.samples[name].append(await self._request(name))

    async def _request(self, client: str) -> float:
        if client == "sdk":
            return await sdk_ttft(self._producer, PROMPT, self._tokens)
        return await httpx2_chat_ttft(self._http, self._payload)

    def count(self) -> int:
        return len(self.samples["gateway"])

    def rows(self) -> dict[str, Any]:
        return {name: latency_row(found) if found else None for name, found in self.samples.items()}


async def _idle(interactive: Interactive, args: argparse.Namespace) -> dict[str, Any]:
    while interactive.count() < args.interactive:
        await interactive.turn()
    return interactive.rows()


async def _during_batch(
    interactive: Interactive, watch: BatchWatch, args: argparse.Namespace
) -> dict[str, Any]:
    await watch.running.wait()
    while interactive.count() < args.interactive and watch.saturating(args.slots):
        await interactive.turn()
    return interactive.rows()


async def _run_batch(
    client: openai.AsyncOpenAI, interactive: Interactive, args: argparse.Namespace
) -> tuple[dict[str, Any], dict[str, Any]]:
    content = batch_file(QUEUE, args.batch_requests, args.batch_tokens)
    upload = await client.files.create(file=("batch.jsonl", io.BytesIO(content)), purpose="batch")
    created_at = time.monotonic()
    batch = await client.batches.create(
        input_file_id=upload.id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    watch = BatchWatch(client, batch.id, created_at)
    poller = asyncio.create_task(watch.poll())
    try:
        during = await _during_batch(interactive, watch, args)
        await asyncio.wait_for(asyncio.shield(poller), args.batch_timeout_s)
    finally:
        poller.cancel()
    return during, watch.figures()


async def measure_reserve(stack: GatewayStack, args: argparse.Namespace) -> dict[str, Any]:
    async with (
        openai.AsyncOpenAI(base_url=f"{stack.openai_url}/v1", api_key="x", max_retries=0) as client,
        httpx2.AsyncClient(base_url=stack.openai_url, timeout=120.0) as http,
        AsyncProducer(stack.redis_url, queue=QUEUE) as producer,
    ):
        warm = Interactive(http, producer, args)
        for _ in range(args.warmup):
            await warm.turn()
        idle = await _idle(Interactive(http, producer, args), args)
        during, batch = await _run_batch(client, Interactive(http, producer, args), args)
    return {"idle": idle, "during_batch": during, "batch": batch}


def run(args: argparse.Namespace) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for name in args.reserves:
        worker = EchoWorker(args.tps, max_batch_size=args.slots, env=RESERVES[name])
        with GatewayStack(QUEUE, [worker], openai=True) as stack:
            results[name] = asyncio.run(measure_reserve(stack, args))
        print(f"reserve {name}: {json.dumps(results[name])}", flush=True)
    return {
        "worker_slots": args.slots,
        "worker_tokens_per_second": args.tps,
        "batch_requests": args.batch_requests,
        "batch_tokens": args.batch_tokens,
        "interactive_tokens": args.interactive_tokens,
        "interactive_clients": {
            "gateway": "streaming chat through the OpenAI gateway (httpx2), to the first content",
            "sdk": "AsyncProducer.submit to the first TokenEvent with text",
        },
        "interactive_gap_ms": args.gap_ms,
        "reserves": results,
    }


def print_lanes(result: dict[str, Any]) -> None:
    rows = []
    for name, found in result["reserves"].items():
        batch = found["batch"]
        for client in Interactive.CLIENTS:
            idle = found["idle"][client] or {}
            during = found["during_batch"][client] or {}
            rows.append(
                [name, client, idle.get("p50_ms"), idle.get("p99_ms"), during.get("n"),
                 during.get("p50_ms"), during.get("p99_ms"),
                 f"{batch['completed']}/{batch['total']}", batch["duration_s"],
                 batch["requests_per_s"]]
            )  # fmt: skip
    columns = ["reserve", "client", "idle p50 ms", "idle p99 ms", "n during", "batch p50 ms",
               "batch p99 ms", "batch done", "batch s", "batch req/s"]  # fmt: skip
    print_table(
        f"Interactive TTFT during a batch ({result['worker_slots']} slots, echo at "
        f"{result['worker_tokens_per_second']:g} tok/s)",
        columns,
        rows,
    )


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    ap.add_argument("--slots", type=int, default=32, help="the worker's --max-batch-size")
    ap.add_argument("--tps", type=float, default=100.0, help="the echo worker's pace")
    ap.add_argument("--batch-requests", type=int, default=2000)
    ap.add_argument("--batch-tokens", type=int, default=40, help="max_tokens of a batch line")
    ap.add_argument("--batch-timeout-s", type=float, default=600.0)
    ap.add_argument(
        "--interactive", type=int, default=200, help="timed requests per client per phase"
    )
    ap.add_argument("--interactive-tokens", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--gap-ms", type=float, default=20.0, help="most pause between requests")
    ap.add_argument("--seed", type=int, default=1, help="of the pauses")
    ap.add_argument("--reserves", type=lambda s: s.split(","), default=list(RESERVES))
    ap.add_argument("--out", default=str(RESULTS), help="folder for the JSON; '' writes none")
    args = ap.parse_args(argv)
    if args.quick:
        args.slots, args.batch_requests, args.batch_tokens = 8, 80, 20
        args.interactive, args.warmup = 5, 1
    return args


def main() -> None:
    args = parse_args()
    result = run(args)
    print_lanes(result)
    path = write_summary(args.out, "lanes-bench", result)
    if path is not None:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""The producer SDK's own costs, against a real redis-server and no worker (no GPU needed).

- ``submit``: a burst of N jobs (256-token prompts) submitted at once from N tasks, on a
  producer whose connections are open; the median job's ``submit()`` return, and the
  last one's. This is the SDK's share of the TTFT that `bench.paired` reports. Also when
  the burst's first and last entries landed in the stream (their ids' server
  milliseconds, so to 1 ms): a worker can start on the first. On Python >= 3.12 each
  burst size runs twice, with full pieces written at once (``EAGER_SEND``) and without.
- ``events``: N jobs whose events a publisher process sends as an engine would (one token
  event per job per step, then a done event); the SDK's CPU time per event received,
  through ``JobHandle.stream()``. At a few jobs the cost of each wake-up of the event loop
  dominates it; at many, the cost of an event.

    python -m bench.sdk_path --concurrency 1,8,32,64,128 --repeats 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime as dt
import json
import multiprocessing as mp
import os
import platform
import statistics
import time
from multiprocessing.synchronize import Event as ProcessEvent
from pathlib import Path
from typing import Any

import redis

from exlq.producer import submit_batch
from exlq.producer.client import AsyncProducer, JobHandle
from exlq.protocol.keys import QueueKeys
from exlq.protocol.models import DoneEvent, Timings, TokenEvent, Usage
from exlq.worker.embedded_redis import RedisServer

QUEUE = "sdk-bench"
PROMPT_TOKENS = 256
RESULTS = Path(__file__).resolve().parent / "results"


def cpu_model() -> str:
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine()


def publish_events(
    url: str, job_ids: list[str], steps: int, step_s: float, go: ProcessEvent
) -> None:
    """In its own process, as a worker: a token event per job per step, then done."""
    keys = QueueKeys(QUEUE)
    client = redis.Redis.from_url(url)
    go.wait()
    for seq in range(steps):
        pipe = client.pipeline(transaction=False)
        for job in job_ids:
            event = TokenEvent(id=job, seq=seq, text=" tok", token_ids=[1234])
            pipe.publish(keys.events(job), event.model_dump_json())
        pipe.execute()
        time.sleep(step_s)
    pipe = client.pipeline(transaction=False)
    for job in job_ids:
        done = DoneEvent(
            id=job,
            seq=steps,
            finish_reason="length",
            usage=Usage(prompt_tokens=PROMPT_TOKENS, completion_tokens=steps),
            timings=Timings(queued_s=0.0, first_token_s=0.0, total_s=0.0),
        )
        pipe.publish(keys.events(job), done.model_dump_json())
    pipe.execute()
    client.close()


async def _release(producer: AsyncProducer, handles: list[JobHandle]) -> None:
    await asyncio.gather(*(h.detach() for h in handles))


async def _timed_submit(
    producer: AsyncProducer, prompt: list[int], t0: float, returned: list[float]
) -> JobHandle:
    handle = await producer.submit(input_ids=prompt, max_new_tokens=128)
    returned.append(time.perf_counter() - t0)
    return handle


def _entry_ms(entry_id: object) -> int:
    """The server's milliseconds in a stream entry id ("<ms>-<seq>")."""
    text = entry_id.decode() if isinstance(entry_id, bytes) else str(entry_id)
    return int(text.split("-")[0])


async def measure_submit(producer: AsyncProducer, n: int, repeats: int) -> dict[str, Any]:
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    jobs = QueueKeys(QUEUE).jobs
    medians: list[float] = []
    lasts: list[float] = []
    landed_first: list[float] = []
    landed_last: list[float] = []
    for _ in range(repeats):
        returned: list[float] = []
        wall0 = time.time() * 1000
        t0 = time.perf_counter()
        handles = await asyncio.gather(
            *(_timed_submit(producer, prompt, t0, returned) for _ in range(n))
        )
        medians.append(statistics.median(returned) * 1000)
        lasts.append(max(returned) * 1000)
        entries = await producer._redis.xrevrange(jobs, count=n) or []
        landed = [_entry_ms(entry_id) - wall0 for entry_id, _ in entries]
        landed_first.append(min(landed))
        landed_last.append(max(landed))
        await _release(producer, handles)
        await asyncio.sleep(0.01)
    return {
        "concurrency": n,
        "repeats": repeats,
        "pieces_written_at_once": submit_batch.EAGER_SEND,
        "submit_ms_p50": statistics.median(medians),
        "submit_ms_last": statistics.median(lasts),
        "submit_ms_p50_min": min(medians),
        "submit_ms_p50_max": max(medians),
        "first_entry_landed_ms": statistics.median(landed_first),
        "last_entry_landed_ms": statistics.median(landed_last),
    }


async def measure_submit_modes(
    producer: AsyncProducer, n: int, repeats: int
) -> list[dict[str, Any]]:
    """Each burst size as the SDK sends it here; on Python >= 3.12 also without writing
    full pieces at once, in turn, for the comparison."""
    if not submit_batch.EAGER_SEND:
        return [await measure_submit(producer, n, repeats)]
    rows: list[dict[str, Any]] = []
    try:
        for eager in (True, False):
            submit_batch.EAGER_SEND = eager
            rows.append(await measure_submit(producer, n, repeats))
    finally:
        submit_batch.EAGER_SEND = True
    return rows


async def measure_events(producer: AsyncProducer, url: str, n: int, steps: int) -> dict[str, Any]:
    prompt = list(range(1000, 1000 + PROMPT_TOKENS))
    handles = await asyncio.gather(
        *(producer.submit(input_ids=prompt, max_new_tokens=steps) for _ in range(n))
    )
    spawn = mp.get_context("spawn")
    go = spawn.Event()
    publisher = spawn.Process(
        target=publish_events, args=(url, [h.id for h in handles], steps, 0.002, go)
    )
    publisher.start()
    await asyncio.sleep(1.0)  # the publisher has started and connected

    async def drain(handle: JobHandle) -> int:
        return sum([1 async for _ in handle.stream()])

    cpu0 = time.process_time()
    go.set()
    received = sum(await asyncio.gather(*(drain(h) for h in handles)))
    cpu_s = time.process_time() - cpu0
    publisher.join()
    if received != n * (steps + 1):
        raise RuntimeError(f"received {received} events of {n * (steps + 1)}")
    return {"concurrency": n, "events": received, "cpu_us_per_event": cpu_s / received * 1e6}


async def measure(concurrencies: list[int], repeats: int, steps: int) -> dict[str, Any]:
    with RedisServer() as server:
        async with AsyncProducer(server.url, queue=QUEUE) as producer:
            # Open as many connections as the largest burst uses, and load the script.
            warm = await asyncio.gather(
                *(producer.submit("warm up", max_new_tokens=1) for _ in range(max(concurrencies)))
            )
            await _release(producer, warm)
            submit = [
                row
                for n in concurrencies
                for row in await measure_submit_modes(producer, n, repeats)
            ]
            events = [await measure_events(producer, server.url, n, steps) for n in concurrencies]
            one_write = getattr(producer._router, "commands_while_subscribed", False)
    return {"submit": submit, "events": events, "submit_in_one_write": one_write}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--repeats", type=int, default=20, help="bursts per concurrency")
    ap.add_argument("--steps", type=int, default=64, help="token events per job")
    ap.add_argument("--out", default=str(RESULTS), help="folder for the JSON; '' writes none")
    args = ap.parse_args()
    concurrencies = [int(n) for n in args.concurrency.split(",")]
    result = asyncio.run(measure(concurrencies, args.repeats, args.steps))
    for row in result["submit"]:
        print(
            f"submit n={row['concurrency']}: p50 {row['submit_ms_p50']:.2f} ms "
            f"({row['submit_ms_p50_min']:.2f}-{row['submit_ms_p50_max']:.2f}), "
            f"last {row['submit_ms_last']:.2f} ms; entries landed after "
            f"{row['first_entry_landed_ms']:.1f} (first) / {row['last_entry_landed_ms']:.1f} "
            f"(last) ms; full pieces written at once: {row['pieces_written_at_once']}"
        )
    for row in result["events"]:
        print(f"events n={row['concurrency']}: {row['cpu_us_per_event']:.1f} us CPU per event")
    if args.out:
        meta = {
            "host": platform.node(),
            "cpu": cpu_model(),
            "cpus": os.cpu_count(),
            "date": dt.date.today().isoformat(),
            "command": f"python -m bench.sdk_path --concurrency {args.concurrency} "
            f"--repeats {args.repeats} --steps {args.steps}",
        }
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"{meta['date']}-sdk-path.json"
        path.write_text(json.dumps({"meta": meta, **result}, indent=2))
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What a Redis shard carries for exlq, and what one job and one token cost it, measured on
a local Redis Cluster (bench/local_cluster.py: 3 masters, 3 replicas) with echo-engine
workers (`exlq worker --engine echo`, no GPU) and the SDK, each a process of this machine:

    python -m bench.cluster_capacity --workers 1,2,4,8 --jobs 400 --tokens 8,64

For each count of workers, on one queue, dealt over four queues (four workers or more) and
on one queue split in four partitions (docs/SCALING.md), and two lengths of job, it prints
jobs/s, token events/s, each master's Redis CPU (seconds of CPU per second, from INFO cpu),
and, from INFO commandstats and the network counters of every master, the Redis commands
and bytes a job costs; a straight line through the two lengths splits that into a job's own
cost and each token's. The echo workers make tokens as fast as they can
(--tokens-per-second), so Redis, the workers and the producer share this machine's CPUs:
the costs carry over to other machines roughly, the rates not.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from bench.local_cluster import LocalCluster, Node, find_cluster_server
from exlq.producer import AsyncProducer
from exlq.protocol.keys import QueueKeys
from exlq.protocol.slot_routing import slot_client


@dataclass
class Counters:
    """One master's counters at one moment."""

    cpu_s: float
    calls: dict[str, int]
    bytes_in: int
    bytes_out: int

    @classmethod
    def read(cls, node: Node) -> Counters:
        client = node.client()
        cpu = client.info("cpu")
        stats = client.info("stats")
        commands = client.info("commandstats")
        return cls(
            float(cpu["used_cpu_sys"]) + float(cpu["used_cpu_user"]),
            {name.removeprefix("cmdstat_"): int(v["calls"]) for name, v in commands.items()},
            int(stats["total_net_input_bytes"]),
            int(stats["total_net_output_bytes"]),
        )


def _since(before: Counters, after: Counters) -> Counters:
    calls = {k: v - before.calls.get(k, 0) for k, v in after.calls.items()}
    return Counters(
        after.cpu_s - before.cpu_s,
        {k: v for k, v in calls.items() if v},
        after.bytes_in - before.bytes_in,
        after.bytes_out - before.bytes_out,
    )


@dataclass(frozen=True)
class Layout:
    """How the bench's jobs are laid out: its queues, each split in ``partitions``."""

    name: str
    queues: list[str]
    partitions: int = 1


LAYOUTS = {
    "one": Layout("one queue", ["capacity"]),
    "four": Layout("four queues", ["cap-a", "cap-b", "cap-c", "cap-d"]),
    "partitioned": Layout("one queue, four partitions", ["capacity-p"], partitions=4),
}


def start_workers(url: str, layout: Layout, count: int, args: argparse.Namespace) -> Any:
    """``count`` echo workers, dealt round the layout's queues; returns the processes once
    each has a ready heartbeat."""
    queues = layout.queues
    log = tempfile.TemporaryFile()  # noqa: SIM115 - lives with the processes
    processes = []
    for i in range(count):
        queue = queues[i % len(queues)]
        command = [sys.executable, "-m", "exlq", "worker", "--engine", "echo"]
        command += ["--redis-url", url, "--queue", queue, "--metrics-port", "0"]
        command += ["--max-batch-size", str(args.batch)]
        command += ["-o", f"tokens_per_second={args.tokens_per_second}"]
        env = {**os.environ, "EXLQ_CONSUMER_NAME": f"bench-{i}"}
        env["EXLQ_PARTITIONS"] = str(layout.partitions)
        processes.append(subprocess.Popen(command, stdout=log, stderr=log, env=env))
    deadline = time.monotonic() + 60
    while sum(_ready(url, queue) for queue in set(queues)) < count:
        if time.monotonic() > deadline or any(p.poll() is not None for p in processes):
            log.seek(0)
            raise RuntimeError("workers did not start:\n" + log.read().decode()[-3000:])
        time.sleep(0.1)
    return processes


def stop_workers(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        process.terminate()
    for process in processes:
        process.wait(30)


def _ready(url: str, queue: str) -> int:
    """The queue's workers whose heartbeat says ready, read on the queue's master."""
    client = redis.Redis.from_url(url)
    node = slot_client(client, QueueKeys(queue).workers)
    try:
        beats = node.hvals(QueueKeys(queue).workers)
        return sum(bool(json.loads(beat).get("ready")) for beat in beats)
    finally:
        if node is not client:
            node.close()
        client.close()


async def burst(url: str, queues: list[str], jobs: int, tokens: int, replicas: int = 0) -> float:
    """Submit ``jobs`` jobs spread over the queues at once and wait for every result;
    returns the wall time. ``replicas``: the producers' (a WAIT behind each submit)."""
    producers = [AsyncProducer(url, queue=queue, replicas=replicas) for queue in queues]
    started = time.perf_counter()

    async def one(i: int) -> None:
        producer = producers[i % len(producers)]
        handle = await producer.submit(f"job {i}", max_new_tokens=tokens)
        await handle.result(timeout=300)

    await asyncio.gather(*(one(i) for i in range(jobs)))
    wall = time.perf_counter() - started
    for producer in producers:
        await producer.close()
    return wall


def run_case(cluster: LocalCluster, layout: Layout, workers: int, args: Any) -> dict[str, Any]:
    queues = layout.queues
    processes = start_workers(cluster.url, layout, workers, args)
    try:
        asyncio.run(burst(cluster.url, queues, min(args.jobs, 32), 4))  # first-use costs
        masters = cluster.masters_now()
        before = {node.port: Counters.read(node) for node in masters}
        wall = asyncio.run(burst(cluster.url, queues, args.jobs, args.tokens))
        spent = {node.port: _since(before[node.port], Counters.read(node)) for node in masters}
    finally:
        stop_workers(processes)
        cluster.flush()
    tokens = args.jobs * args.tokens
    calls: dict[str, int] = {}
    for counted in spent.values():
        for name, count in counted.calls.items():
            calls[name] = calls.get(name, 0) + count
    events = calls.get("spublish", 0) + calls.get("publish", 0)
    cpu_s = sum(c.cpu_s for c in spent.values())
    busy = sorted((c.cpu_s / wall for c in spent.values()), reverse=True)
    return {
        "layout": layout.name,
        "queues": len(queues),
        "partitions": layout.partitions,
        "workers": workers,
        "tokens_per_job": args.tokens,
        "jobs_per_s": round(args.jobs / wall, 1),
        "token_events_per_s": round(events / wall),
        "tokens_per_event": round(tokens / events, 2) if events else None,
        "busiest_master_cpu": round(busy[0], 2),
        "masters_cpu": [round(cpu, 2) for cpu in busy],
        "commands_per_job": round(sum(calls.values()) / args.jobs, 1),
        "bytes_in_per_job": round(sum(c.bytes_in for c in spent.values()) / args.jobs),
        "bytes_out_per_job": round(sum(c.bytes_out for c in spent.values()) / args.jobs),
        "redis_cpu_us_per_job": round(cpu_s / args.jobs * 1e6, 1),
        "top_commands_per_job": {
            name: round(count / args.jobs, 2)
            for name, count in sorted(calls.items(), key=lambda kv: -kv[1])[:6]
        },
    }


def per_token_costs(short: dict[str, Any], long: dict[str, Any]) -> dict[str, float]:
    """Two runs alike but for their tokens a job: what a job costs Redis apart from its
    tokens, and what each token adds (a straight line through the two)."""
    extra = long["tokens_per_job"] - short["tokens_per_job"]
    costs = {}
    for key in (
        "redis_cpu_us_per_job",
        "commands_per_job",
        "bytes_in_per_job",
        "bytes_out_per_job",
    ):
        per_token = (long[key] - short[key]) / extra
        costs[key.replace("_per_job", "_per_token")] = round(per_token, 3)
        costs[key.replace("_per_job", "_per_job_fixed")] = round(
            short[key] - per_token * short["tokens_per_job"], 1
        )
    return costs


def _counts(text: str) -> list[int]:
    return [int(n) for n in text.split(",")]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", default="1,2,4,8", type=_counts)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--tokens", default="8,64", type=_counts, help="two: the cost fit")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens-per-second", type=float, default=100_000.0)
    parser.add_argument(
        "--layouts", default=",".join(LAYOUTS), help=f"some of {', '.join(LAYOUTS)}"
    )
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    layouts = [LAYOUTS[name] for name in args.layouts.split(",")]
    binary = find_cluster_server()
    if binary is None:
        raise SystemExit("needs a redis-server >= 7 (EXLQ_CLUSTER_REDIS_SERVER)")
    rows = []
    token_counts = args.tokens
    with LocalCluster(binary) as cluster:
        for layout in layouts:
            # Each worker serves one queue, and reads every partition of it.
            for workers in [n for n in args.workers if n >= len(layout.queues)]:
                for tokens in token_counts:
                    args.tokens = tokens
                    row = run_case(cluster, layout, workers, args)
                    print(json.dumps(row), flush=True)
                    rows.append(row)
    short, long = rows[0], rows[1]  # one queue, the fewest workers: Redis least contended
    model = per_token_costs(short, long)
    print(json.dumps({"costs": model}), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps({"rows": rows, "costs": model}, indent=1))


if __name__ == "__main__":
    main()

"""What it costs to close the window in which a failover loses jobs: a Redis Cluster
replicates asynchronously, so a job its master took and had not yet sent to its replica is
gone if the master dies then (docs/SCALING.md, "Failover").

    python -m bench.replica_cost --workers 4 --jobs 400 --tokens 8

On a local Redis Cluster (bench/local_cluster.py) it times submits made one at a time
(p50, p99; a producer without and one with ``replicas=1`` taking turns), then runs a burst
through echo workers on one queue three ways, in turn, --rounds times, and prints the
median jobs/s of each:

- ``async``: as shipped, nothing waits for a replica;
- ``min-replicas``: every master runs with ``min-replicas-to-write 1`` and
  ``min-replicas-max-lag 10`` (a master cut off from its replica refuses writes after 10 s,
  and the SDK's submits, refused, go to the new master once it is elected);
- ``wait``: the producers submit with ``replicas=1``, a Redis WAIT behind every submit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path

from bench.cluster_capacity import LAYOUTS, burst, start_workers, stop_workers
from bench.local_cluster import LocalCluster, find_cluster_server
from exlq.producer import AsyncProducer

QUEUE = LAYOUTS["one"].queues[0]
HOWS = ("async", "min-replicas", "wait")


async def lone_submits(url: str, count: int) -> dict[int, list[float]]:
    """Seconds a submit made alone takes to return, without and with ``replicas=1``: the
    two producers take turns, so that both see the same machine."""
    took: dict[int, list[float]] = {0: [], 1: []}
    producers = {n: AsyncProducer(url, queue=QUEUE, replicas=n) for n in took}
    try:
        for producer in producers.values():
            await (await producer.submit("warm", max_new_tokens=1)).detach()
        for i in range(count):
            for replicas, producer in producers.items():
                started = time.perf_counter()
                handle = await producer.submit(f"lone {i}", max_new_tokens=1)
                took[replicas].append(time.perf_counter() - started)
                await handle.detach()
    finally:
        for producer in producers.values():
            await producer.close()
    return took


def burst_rate(cluster: LocalCluster, how: str, args: argparse.Namespace) -> float:
    """Jobs/s of a burst of ``args.jobs``, the masters and producers set as ``how`` says."""
    for node in cluster.masters_now():
        client = node.client()
        client.config_set("min-replicas-to-write", 1 if how == "min-replicas" else 0)
        client.config_set("min-replicas-max-lag", 10)
    replicas = 1 if how == "wait" else 0
    processes = start_workers(cluster.url, LAYOUTS["one"], args.workers, args)
    try:
        asyncio.run(burst(cluster.url, [QUEUE], 32, 4, replicas))  # first-use costs
        wall = asyncio.run(burst(cluster.url, [QUEUE], args.jobs, args.tokens, replicas))
    finally:
        stop_workers(processes)
        cluster.flush()
    return round(float(args.jobs) / wall, 1)


def _ms(values: list[float], quantile: float) -> float:
    ordered = sorted(values)
    return round(ordered[min(int(len(ordered) * quantile), len(ordered) - 1)] * 1000, 3)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=4)
    parser.add_argument("--jobs", type=int, default=400)
    parser.add_argument("--tokens", type=int, default=8)
    parser.add_argument("--lone", type=int, default=500, help="lone submits timed, each way")
    parser.add_argument("--rounds", type=int, default=2, help="bursts of each way")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens-per-second", type=float, default=100_000.0)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    binary = find_cluster_server()
    if binary is None:
        raise SystemExit("needs a redis-server >= 7 (EXLQ_CLUSTER_REDIS_SERVER)")
    with LocalCluster(binary) as cluster:
        cluster.wait_healthy()
        took = asyncio.run(lone_submits(cluster.url, args.lone))
        cluster.flush()
        lone = {
            f"replicas={n}": {"p50_ms": _ms(times, 0.5), "p99_ms": _ms(times, 0.99)}
            for n, times in took.items()
        }
        print(json.dumps({"lone_submit": lone}), flush=True)
        rates: dict[str, list[float]] = {how: [] for how in HOWS}
        for _ in range(args.rounds):
            for how in HOWS:
                rates[how].append(burst_rate(cluster, how, args))
                print(json.dumps({how: rates[how][-1]}), flush=True)
    summary = {
        "lone_submit": lone,
        "jobs_per_s": {how: statistics.median(r) for how, r in rates.items()},
        "burst": f"{args.jobs} jobs of {args.tokens} tokens, {args.workers} echo workers",
    }
    print(json.dumps(summary), flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()

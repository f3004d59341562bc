"""The gateways' costs on this machine's CPUs, with echo workers, Redis and the gateways as
real processes that the script starts and stops (bench.gateway_stack).

- ``--overhead``: what each gateway adds to the time to first token over the SDK.
  Sequential requests on a fast echo worker (``--tps``), the clients in turns: the SDK,
  the OpenAI gateway's streaming chat through httpx2 (kept-alive connection), through a
  raw socket (a new connection per request) and through the ``openai`` client, and the
  WebSocket gateway (one connection, ``infer`` with stream: true). p50/p99 and their
  difference from the SDK's.
- ``--streams``: the most concurrent streams one gateway process holds without an error:
  N streams at once (``--steps``), each a slow echo job of ``--stream-tokens`` words at
  ``--stream-tps``; every stream must bring all its chunks and its end. The gateway's CPU
  and RSS at each N. The client shares the CPUs (it reports its own CPU time).

With neither flag, both run.

    python -m bench.gateway_bench --overhead --requests 300
    python -m bench.gateway_bench --streams --steps 250,500,1000,1500,2000
"""

from __future__ import annotations

import argparse
import asyncio
import math
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any

from bench.figures import print_table, raise_open_files_limit, write_summary
from bench.gateway_capacity import Tally, openai_streams, run_streams, websocket_streams
from bench.gateway_overhead import CLIENTS, measure_overhead
from bench.gateway_stack import EchoWorker, GatewayStack
from bench.sdk_path import RESULTS

QUEUE = "gateway-bench"
MAX_WORKER_SLOTS = 1024  # a worker's largest --max-batch-size
GATEWAYS = ("openai", "websocket")


def run_overhead(args: argparse.Namespace) -> dict[str, Any]:
    worker = EchoWorker(tokens_per_second=args.tps, max_batch_size=8)
    with GatewayStack(QUEUE, [worker], openai=True, websocket=True) as stack:
        result = asyncio.run(measure_overhead(stack, args.requests, args.warmup, args.max_tokens))
    result["worker_tokens_per_second"] = args.tps
    return result


def _workers_for(streams: int, tps: float) -> list[EchoWorker]:
    count = math.ceil(streams / MAX_WORKER_SLOTS)
    slots = math.ceil(streams / count)
    return [EchoWorker(tokens_per_second=tps, max_batch_size=slots) for _ in range(count)]


def _opener(
    stack: GatewayStack, gateway: str, n: int, args: argparse.Namespace
) -> Callable[[Tally], Awaitable[None]]:
    if gateway == "openai":
        return partial(openai_streams, stack.openai_port, QUEUE, n, args.stream_tokens)
    return partial(
        websocket_streams, stack.websocket_url, n, args.ws_per_connection, args.stream_tokens
    )


def _step_gateway(stack: GatewayStack, gateway: str, args: argparse.Namespace) -> dict[str, Any]:
    """N up the steps until a run has an error; the largest N without one."""
    job_s = args.stream_tokens / args.stream_tps
    runs: list[dict[str, Any]] = []
    for n in args.steps:
        opener = _opener(stack, gateway, n, args)
        row = asyncio.run(run_streams(opener, n, stack.pids[gateway], 60 + 3 * job_s))
        runs.append(row)
        print(_run_line(gateway, row), flush=True)
        if row["errors"]:
            break
        time.sleep(1.0)  # the workers' last commits and the gateway's releases settle
    held = [r for r in runs if not r["errors"]]
    return {"runs": runs, "largest_without_errors": held[-1] if held else None}


def _run_line(gateway: str, row: dict[str, Any]) -> str:
    g = row["gateway"]
    return (
        f"{gateway} N={row['streams']}: {row['completed']} whole, {row['errors']} errors, "
        f"peak open {row['peak_open']} (receiving {row['peak_receiving']}), "
        f"{row['wall_s']:.1f}s; gateway CPU {g['cpu_percent_mean']:.0f}% mean / "
        f"{g['cpu_percent_peak']:.0f}% peak, RSS {g['rss_mib_peak']:.0f} MiB; client CPU "
        f"{row['client_cpu_s']:.1f}s {row['error_samples'][:1]}"
    )


def run_capacity(args: argparse.Namespace) -> dict[str, Any]:
    workers = _workers_for(max(args.steps), args.stream_tps)
    with GatewayStack(
        QUEUE, workers, openai="openai" in args.gateways, websocket="websocket" in args.gateways
    ) as stack:
        gateways = {name: _step_gateway(stack, name, args) for name in args.gateways}
    return {
        "stream_tokens": args.stream_tokens,
        "stream_tokens_per_second": args.stream_tps,
        "websocket_infers_per_connection": args.ws_per_connection,
        "workers": [w.max_batch_size for w in workers],
        "gateways": gateways,
    }


def print_overhead(result: dict[str, Any]) -> None:
    rows = [
        [name, r["n"], r["p50_ms"], r["p99_ms"], r["added_p50_ms"], r["added_p99_ms"]]
        for name, r in ((name, result["clients"][name]) for name in CLIENTS)
    ]
    columns = ["client", "n", "TTFT p50 ms", "TTFT p99 ms", "+p50 vs SDK", "+p99 vs SDK"]
    print_table(
        f"Time to first token, echo at {result['worker_tokens_per_second']:g} tok/s",
        columns,
        rows,
    )


def print_capacity(result: dict[str, Any]) -> None:
    rows = []
    for name, found in result["gateways"].items():
        for run in found["runs"]:
            g = run["gateway"]
            rows.append(
                [name, run["streams"], run["completed"], run["errors"], run["peak_open"],
                 g["cpu_percent_mean"], g["cpu_percent_peak"], g["rss_mib_peak"],
                 run["client_cpu_s"]]
            )  # fmt: skip
    columns = ["gateway", "N", "whole", "errors", "peak open", "gw CPU % mean",
               "gw CPU % peak", "gw RSS MiB", "client CPU s"]  # fmt: skip
    print_table("Concurrent streams per gateway process", columns, rows)
    for name, found in result["gateways"].items():
        best = found["largest_without_errors"]
        print(f"{name}: largest N without errors: {best['streams'] if best else 'none'}")


def _ints(text: str) -> list[int]:
    return [int(n) for n in text.split(",") if n]


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--overhead", action="store_true", help="TTFT over the SDK")
    ap.add_argument("--streams", action="store_true", help="concurrent streams per gateway")
    ap.add_argument("--quick", action="store_true", help="tiny sizes, for the smoke test")
    ap.add_argument("--requests", type=int, default=300, help="timed requests per client")
    ap.add_argument("--warmup", type=int, default=30, help="untimed requests per client")
    ap.add_argument("--max-tokens", type=int, default=8, help="words per overhead request")
    ap.add_argument("--tps", type=float, default=1000.0, help="echo pace for --overhead")
    ap.add_argument("--steps", type=_ints, default=[250, 500, 1000, 1500, 2000])
    ap.add_argument("--stream-tokens", type=int, default=64, help="words per stream")
    ap.add_argument("--stream-tps", type=float, default=4.0, help="echo pace for --streams")
    ap.add_argument("--ws-per-connection", type=int, default=1, help="infers per connection")
    ap.add_argument("--gateways", type=lambda s: s.split(","), default=list(GATEWAYS))
    ap.add_argument("--out", default=str(RESULTS), help="folder for the JSON; '' writes none")
    args = ap.parse_args(argv)
    if not (args.overhead or args.streams):
        args.overhead = args.streams = True
    if args.quick:
        args.requests, args.warmup, args.steps = 5, 1, [3, 6]
        args.stream_tokens, args.stream_tps, args.ws_per_connection = 4, 20.0, 2
    return args


def run(args: argparse.Namespace) -> dict[str, Any]:
    raise_open_files_limit()
    result: dict[str, Any] = {}
    if args.overhead:
        result["overhead"] = run_overhead(args)
        print_overhead(result["overhead"])
    if args.streams:
        result["streams"] = run_capacity(args)
        print_capacity(result["streams"])
    return result


def main() -> None:
    args = parse_args()
    result = run(args)
    # Named by the parts it holds: a run of one part leaves another's file alone.
    path = write_summary(args.out, "-".join(["gateway-bench", *result]), result)
    if path is not None:
        print(f"wrote {path}")


if __name__ == "__main__":
    main()

"""What a quiet spell before a burst costs the engine alone's time to first token.

exlq's engine idles while a burst travels to it through Redis; an engine driven in a tight
loop can meet its burst straight after its warm-up jobs. This measures the engine alone
(exlq's engine without the queue, as `bench.paired` loads it) at one concurrency, after
each kind of gap in turn, on new prompts every run:

- ``none``: the burst follows the warm-up jobs at once;
- ``sleep``: the thread sleeps for the gap (the CPU idles, then the GPU);
- ``cpu-spin``: the thread spins for the gap (the GPU idles, the CPU does not);
- ``gpu-busy``: the GPU multiplies matrices for the gap, the thread waits on it.

On the H100 it found sleeping worth 1.1-2.1 ms of TTFT at one job and spinning at most 0.4,
so every bench system now idles `baselines.IDLE_BEFORE_RUN_S` before its burst.

    python -m bench.idle_start --shape 1b --repeats 10
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench import baselines
from bench.make_checkpoint import model_for
from bench.paired import EngineAlone
from bench.placement import on_cpus, placement
from bench.run import RESULTS, gpu_name

KINDS = ("none", "sleep", "cpu-spin", "gpu-busy")


def gap_of(kind: str, seconds: float) -> Callable[[], None]:
    """What the engine's thread does between the warm-up jobs and the burst."""
    import torch

    matrix = torch.randn(2048, 2048, device="cuda", dtype=torch.half)

    def spin() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            pass

    def gpu_busy() -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            for _ in range(20):
                matrix @ matrix
            torch.cuda.synchronize()

    gaps: dict[str, Callable[[], None]] = {
        "none": lambda: None,
        "sleep": lambda: time.sleep(seconds),
        "cpu-spin": spin,
        "gpu-busy": gpu_busy,
    }
    if kind not in gaps:
        raise ValueError(f"unknown gap kind {kind!r}: use one of {', '.join(KINDS)}")
    return gaps[kind]


def measure(args: argparse.Namespace, model: Path) -> list[dict[str, Any]]:
    place = placement(args.worker_cpus)
    with on_cpus(place.server):
        # The worker's defaults: batched prefill, one sampling thread, the admission budget.
        engine = EngineAlone(model, args.concurrency, args.cache_tokens)
    gaps = {kind: gap_of(kind, args.gap_s) for kind in args.kinds}
    rows: list[dict[str, Any]] = []
    try:
        for repeat in range(args.repeats):
            shift = repeat % len(args.kinds)  # each kind in each position, in turn
            for k, kind in enumerate(args.kinds[shift:] + args.kinds[:shift]):
                seed = 20_000 + repeat * 10 + k
                prompts = baselines.random_prompt_ids(model, args.concurrency, 256, seed)
                warm = baselines.random_prompt_ids(model, args.concurrency, 256, seed + 5_000)
                with on_cpus(place.server):
                    baselines.warm_up_jobs(engine.generator, warm)
                    gaps[kind]()
                    run = baselines.run_dynamic(  # the gap under test is the only one
                        engine.generator,
                        model,
                        prompts,
                        args.max_new_tokens,
                        0,
                        "exlq-engine",
                        idle_s=0.0,
                    )
                rows.append(
                    {
                        "kind": kind,
                        "repeat": repeat,
                        "ttft_ms_p50": run["ttft_ms_p50"],
                        "output_tokens_per_s": run["output_tokens_per_s"],
                    }
                )
    finally:
        engine.close()
    return rows


def summarize(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for kind in dict.fromkeys(r["kind"] for r in rows):
        ttft = [r["ttft_ms_p50"] for r in rows if r["kind"] == kind]
        tps = [r["output_tokens_per_s"] for r in rows if r["kind"] == kind]
        out[kind] = {
            "runs": len(ttft),
            "ttft_ms_median": statistics.median(ttft),
            "ttft_ms_min": min(ttft),
            "ttft_ms_max": max(ttft),
            "tokens_per_s_median": statistics.median(tps),
        }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="1b", help="a random-weight shape: 1b or 8b")
    ap.add_argument("--concurrency", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=10, help="runs of each kind")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--gap-s", type=float, default=0.1)
    ap.add_argument("-m", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--worker-cpus", default="auto", help="as for bench.run")
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args()
    args.kinds = args.kinds.split(",")
    unknown = set(args.kinds) - set(KINDS)
    if unknown:
        ap.error(f"--kinds: unknown {', '.join(sorted(unknown))}; use some of {','.join(KINDS)}")
    model, shape = model_for(args.shape, Path(args.models))
    rows = measure(args, model)
    summary = summarize(rows)
    meta = {
        "gpu": gpu_name(),
        "date": dt.date.today().isoformat(),
        "shape": shape,
        "concurrency": args.concurrency,
        "gap_s": args.gap_s,
        "command": f"python -m bench.idle_start --shape {args.shape} --concurrency "
        f"{args.concurrency} --repeats {args.repeats} --kinds {','.join(args.kinds)} "
        f"--gap-s {args.gap_s}",
    }
    stem = f"{meta['date']}-{meta['gpu'].replace(' ', '-')}-idle-start-{shape}"
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": rows}, indent=2)
    )
    for kind, s in summary.items():
        print(
            f"{kind}: TTFT p50 median {s['ttft_ms_median']:.2f} ms "
            f"({s['ttft_ms_min']:.1f}-{s['ttft_ms_max']:.1f}, {s['runs']:.0f} runs), "
            f"{s['tokens_per_s_median']:.0f} tok/s"
        )


if __name__ == "__main__":
    main()

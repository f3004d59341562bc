"""Where one generator iteration's time goes, at a given number of jobs: wall time per
decode step, the Python functions that cost it (cProfile), and the GPU time (torch profiler).

    python -m bench.profile_step --model DIR --jobs 1,64 --cache-tokens 16384
    python -m bench.profile_step --model DIR --jobs 1,64,128 --graphs --gpu-sampling --overlap-pairs
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import statistics
import time
from pathlib import Path
from typing import Any

from bench.baselines import random_prompt_ids


def build(
    model_dir: str, jobs: int, cache_tokens: int, chunk: int, threads: int, graphs: bool,
    gpu_sampling: bool, gpu_embedding: bool = False,
) -> Any:  # fmt: skip
    from exlq.worker.engines.exllamav2.attention import install_attention
    from exlq.worker.engines.exllamav2.load import load_generator, warm_up

    install_attention("exlq")
    loaded = load_generator(
        model_dir,
        max_batch_size=jobs,
        cache_tokens=cache_tokens,
        gpu_sampling=gpu_sampling,
        prefill_batch_tokens=0,
        max_chunk_size=chunk,
        sampling_threads=threads,
        decode_graphs=graphs,
        gpu_embedding=gpu_embedding,
    )
    decode_graphs = warm_up(loaded).graphs
    if graphs:
        assert decode_graphs is not None
        print(f"CUDA graphs for 1..{jobs} jobs captured in {decode_graphs.capture_seconds:.1f} s")
        if decode_graphs.padded:
            print(f"batches of {sorted(decode_graphs.padded)} jobs replay padded")
    return loaded, decode_graphs


def fill(
    generator: Any, model_dir: str, jobs: int, prompt_tokens: int, max_new_tokens: int
) -> None:
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    for j, ids in enumerate(random_prompt_ids(model_dir, jobs, prompt_tokens, 0)):
        generator.enqueue(
            ExLlamaV2DynamicJob(
                input_ids=torch.tensor([ids]),
                max_new_tokens=max_new_tokens,
                stop_conditions=[],
                gen_settings=ExLlamaV2Sampler.Settings.greedy(),
                identifier=j,
            )
        )
    # Run through prefill into steady decode.
    while any(not job.is_prefill_done() for job in generator.active_jobs) or generator.pending_jobs:
        generator.iterate()
    for _ in range(5):
        generator.iterate()


def timed_steps(generator: Any, steps: int) -> list[float]:
    """Wall time of each of `steps` iterations, ms, the GPU idle before and after each."""
    import torch

    walls = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        generator.iterate()
        torch.cuda.synchronize()
        walls.append((time.perf_counter() - started) * 1000)
    return walls


def streamed_steps(generator: Any, steps: int) -> float:
    """Wall time per iteration, ms, over `steps` iterations run back to back (as the engine
    runs them: a step may be launched before the one ahead of it is read)."""
    import torch

    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(steps):
        generator.iterate()
    torch.cuda.synchronize()
    return (time.perf_counter() - started) * 1000 / steps


def overlap_pairs(generator: Any, steps: int, pairs: int = 3) -> dict[str, list[float]]:
    """The same jobs stepped back to back with overlapped decode steps off and on, in turn:
    ms per step of each turn."""
    overlap = generator.overlap
    if overlap is None:
        raise SystemExit("no overlapped steps: they need --graphs and --gpu-sampling")
    turns: dict[str, list[float]] = {"off": [], "on": []}
    for _ in range(pairs):
        for name, enabled in (("off", False), ("on", True)):
            overlap.enabled = enabled
            generator.iterate()  # the switch's step (off: the step in flight is read)
            turns[name].append(streamed_steps(generator, steps))
    overlap.enabled = True
    return turns


def profile(model_dir: str, jobs: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    loaded, graphs = build(
        model_dir, jobs, args.cache_tokens, args.chunk, args.sampling_threads, args.graphs,
        args.gpu_sampling, args.overlap_pairs,
    )  # fmt: skip
    generator = loaded.generator
    fill(generator, model_dir, jobs, args.prompt_tokens, args.max_new_tokens)
    if args.overlap_pairs:
        turns = overlap_pairs(generator, args.steps)
        generator.clear_queue()
        loaded.unload()
        return {"jobs": jobs, "overlap_step_ms": turns}
    walls = timed_steps(generator, args.steps)
    padding: dict[str, list[float]] = {}
    if graphs is not None and jobs in graphs.padded:
        # The same jobs stepped unpadded and padded in turn (EXL2 weights).
        chosen = graphs.padded
        padding = {"unpadded": [], "padded": []}
        for _ in range(2):
            graphs.use_padding({})
            padding["unpadded"].append(statistics.median(timed_steps(generator, args.steps)))
            graphs.use_padding(chosen)
            padding["padded"].append(statistics.median(timed_steps(generator, args.steps)))
    if not args.profile:
        generator.clear_queue()
        loaded.unload()
        return {
            "jobs": jobs,
            "graphs": args.graphs,
            "gpu_sampling": args.gpu_sampling,
            "step_ms_median": statistics.median(walls),
            **({"padding_step_ms": padding} if padding else {}),
        }
    profiler = cProfile.Profile()
    profiler.enable()
    for _ in range(args.steps):
        generator.iterate()
    profiler.disable()
    text = io.StringIO()
    stats = pstats.Stats(profiler, stream=text)
    stats.sort_stats("tottime").print_stats(30)
    stats.sort_stats("cumulative").print_stats(40)
    with torch.profiler.profile(
        activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    ) as prof:
        for _ in range(5):
            generator.iterate()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_us = sum(e.self_device_time_total for e in events) / 5
    table = events.table(sort_by="self_device_time_total", row_limit=15)
    cpu_table = events.table(sort_by="self_cpu_time_total", row_limit=15)
    generator.clear_queue()
    loaded.unload()
    del generator, loaded
    torch.cuda.empty_cache()
    return {
        "jobs": jobs,
        "cache_tokens": args.cache_tokens,
        "step_ms_median": statistics.median(walls),
        "gpu_ms_per_step": gpu_us / 1000,
        "python_top": text.getvalue(),
        "gpu_top": table,
        "cpu_top": cpu_table,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--jobs", default="1,64")
    ap.add_argument("--cache-tokens", type=int, default=16384)
    ap.add_argument("--chunk", type=int, default=2048)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=256)
    ap.add_argument("--sampling-threads", type=int, default=16, help="exllamav2's default: 16")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--graphs", action="store_true", help="decode from CUDA graphs")
    ap.add_argument("--gpu-sampling", action="store_true", help="exlq's generator")
    ap.add_argument("--no-profile", dest="profile", action="store_false", help="step times only")
    ap.add_argument(
        "--overlap-pairs",
        action="store_true",
        help="step times with overlapped decode steps off and on, in turn (the embedding "
        "table on the GPU; with --graphs --gpu-sampling)",
    )
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    results = [profile(args.model, int(n), args) for n in args.jobs.split(",")]
    for r in results:
        if "overlap_step_ms" in r:
            turns = r["overlap_step_ms"]
            print(
                f"== {r['jobs']} jobs, ms/step in turn: overlap off "
                f"{' / '.join(f'{ms:.2f}' for ms in turns['off'])}, on "
                f"{' / '.join(f'{ms:.2f}' for ms in turns['on'])}"
            )
            continue
        if "gpu_ms_per_step" not in r:
            print(
                f"== {r['jobs']} jobs, graphs {r['graphs']}, GPU sampling {r['gpu_sampling']}: "
                f"{r['step_ms_median']:.2f} ms/step"
            )
            if "padding_step_ms" in r:
                turns = r["padding_step_ms"]
                print(
                    f"   in turn, unpadded {' / '.join(f'{ms:.2f}' for ms in turns['unpadded'])}"
                    f", padded {' / '.join(f'{ms:.2f}' for ms in turns['padded'])} ms/step"
                )
            continue
        print(
            f"== {r['jobs']} jobs, cache {r['cache_tokens']}: {r['step_ms_median']:.2f} ms/step "
            f"wall, {r['gpu_ms_per_step']:.2f} ms GPU"
        )
        print(r["python_top"][:12000])
        print(r["gpu_top"])
        print(r["cpu_top"])
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()

"""One command, one GPU: exllamav2's stock generator, exlq's engine alone, the exlq path,
exllamav2's websocket server and transformers on the same random-weight checkpoints; JSON
and a markdown table out.

    python -m bench.run --shapes 1b,8b --concurrency 1,8,32,64,128
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from bench import baselines
from bench.exlq_path import add_engine_options, bench_exlq, engine_options, worker_options
from bench.make_checkpoint import model_for
from bench.placement import AUTO_MIN_CPUS, AUTO_SERVER_CPUS, Placement, on_cpus, placement

# Systems whose model runs inside the bench process.
IN_PROCESS = "aed"
RESULTS = Path(__file__).resolve().parent / "results"
COLUMNS = [
    ("system", "system"),
    ("concurrency", "N"),
    ("output_tokens_per_s", "tok/s"),
    ("tok_s_range", "tok/s range"),
    ("ttft_ms_p50", "TTFT p50 ms"),
    ("ttft_ms_p99", "TTFT p99 ms"),
    ("itl_ms_p50", "ITL p50 ms"),
    ("itl_ms_p99", "ITL p99 ms"),
    ("step_ms", "ms/step"),
    ("peak_gpu_mem_gib", "peak GiB"),
]


def measure_bandwidth() -> float:
    """Device-to-device copy, bytes read plus written per second (median of 20)."""
    import torch

    src = torch.empty(2 * 1024**3 // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    times = []
    for _ in range(23):
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        start.record()
        dst.copy_(src)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    del src, dst
    torch.cuda.empty_cache()
    median = sorted(times[3:])[len(times[3:]) // 2]
    return float(2 * 2 * 1024**3 / median)


def gpu_name() -> str:
    import torch

    return str(torch.cuda.get_device_name(0))


def exlq_attention_patch() -> None:
    from exlq.worker.engines.exllamav2.attention import install_attention

    install_attention("exlq")


def run_shape(
    shape: str, args: argparse.Namespace, bandwidth: float, place: Placement
) -> list[dict[str, Any]]:
    """Every asked-for system at every concurrency on one model (`model_for`'s `shape`)."""
    model, shape = model_for(shape, Path(args.models))
    floor_ms = baselines.memory_bandwidth_floor_ms(model, bandwidth)
    rows: list[dict[str, Any]] = []
    point = {"prompt_tokens": args.prompt_tokens, "max_new_tokens": args.max_new_tokens}

    def record(row: dict[str, Any]) -> None:
        row.update(shape=shape, floor_ms=floor_ms)
        # Mean over every step, prefill steps included: what the worker's metric gives for exlq.
        row["step_ms"] = row.get("step_ms_mean")
        rows.append(row)
        print(json.dumps({k: row.get(k) for k, _ in COLUMNS} | {"shape": shape}), flush=True)

    def generator_alone(exlq_decode: bool) -> Iterator[dict[str, Any]]:
        return (
            baselines.bench_exllamav2_dynamic(
                model,
                n,
                attn_patch=exlq_attention_patch,
                max_batch_size=max(args.concurrency),
                exlq_decode=exlq_decode,
                # One CPU sampling thread, as exlq's engine always runs: measured faster
                # than exllamav2's default of 16 (docs/PERFORMANCE.md), so (a) gets it too.
                sampling_threads=1,
                **engine_options(args),
                **point,
            )
            for n in args.concurrency
        )

    # Each system's rows, one point at a time (lazily: a failure keeps the points before it).
    systems: dict[str, Callable[[], Iterable[dict[str, Any]]]] = {
        "a": lambda: generator_alone(exlq_decode=False),
        "e": lambda: generator_alone(exlq_decode=True),
        "b": lambda: bench_exlq(
            model,
            args.concurrency,
            options=worker_options(engine_options(args)),
            engine_runner=args.engine_runner,
            worker_cpus=place.server,
            **point,
        ),
        "c": lambda: (
            baselines.bench_exllamav2_websocket(
                model, n, timeout_s=args.ws_window_s, server_cpus=place.server, **point
            )
            for n in args.concurrency
        ),
        "d": lambda: (
            baselines.bench_transformers(model, n, cache_tokens=args.cache_tokens, **point)
            for n in args.concurrency
        ),
    }
    for repeat in range(args.repeats):
        for key in args.systems:
            if repeat and key not in args.repeat_systems:
                continue
            started = time.monotonic()
            # (a), (e) and (d) run the model in this process: on the system's CPUs. (b) and (c)
            # start it in a child on those CPUs, and this process drives clients from the rest.
            cpus = place.server if key in IN_PROCESS else place.load
            try:
                with on_cpus(cpus):
                    for row in systems[key]():
                        record(row)
            except Exception as exc:  # one system failing must not lose the others' figures
                rows.append({"shape": shape, "system": key, "error": repr(exc)})
                print(f"system {key} on {shape} failed: {exc!r}", flush=True)
            print(f"system {key} on {shape}: {time.monotonic() - started:.0f}s", flush=True)
    return merge_repeats(rows)


def merge_repeats(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (system, N): the median of the runs' tok/s and of their TTFT p50, every
    run's tok/s, and the other figures of the median run (the lower middle one of an even
    count). Runs on our GPU machine spread by up to 40%."""
    merged: list[dict[str, Any]] = []
    groups: dict[tuple[str, int], list[dict[str, Any]]] = {}
    for row in rows:
        if "error" in row:
            merged.append(row)
        else:
            groups.setdefault((row["system"], row["concurrency"]), []).append(row)
    for runs in groups.values():
        ranked = sorted(runs, key=lambda r: r.get("output_tokens_per_s") or 0.0)
        row = dict(ranked[(len(ranked) - 1) // 2])
        row["runs"] = len(runs)
        row["tok_s_runs"] = [r.get("output_tokens_per_s") or 0.0 for r in runs]
        row["output_tokens_per_s"] = statistics.median(row["tok_s_runs"])
        if len(runs) > 1:
            row["tok_s_range"] = f"{min(row['tok_s_runs']):,.0f}-{max(row['tok_s_runs']):,.0f}"
        ttfts = [r["ttft_ms_p50"] for r in runs if r.get("ttft_ms_p50") is not None]
        if ttfts:
            row["ttft_ms_p50"] = statistics.median(ttfts)
            row["ttft_ms_p50_runs"] = ttfts
        merged.append(row)
    return merged


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.0f}" if value >= 100 else f"{value:.2f}"
    return str(value)


def markdown(rows: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"GPU: {meta['gpu']}, measured copy bandwidth {meta['bandwidth_tb_s']:.2f} TB/s; "
        f"{meta['date']}; prompt {meta['prompt_tokens']} tokens, {meta['max_new_tokens']} new "
        f"tokens, EOS ignored, greedy; cache {meta['cache_tokens']} tokens. TTFT and ITL are "
        "per event as the caller receives it for the bare generator, exlq and the websocket "
        "server (exllamav2 holds back text that ends in partial UTF-8, so a chunk of several "
        "tokens is one event), per token for transformers. ms/step is the mean over every "
        "generator step, prefill steps included. With repeats, tok/s and TTFT p50 are "
        "medians over the runs." + (f" CPUs: {meta['cpus']}." if meta.get("cpus") else ""),
        f"Command: `{meta['command']}`",
        "",
    ]
    for shape in dict.fromkeys(r["shape"] for r in rows):
        mine = [r for r in rows if r["shape"] == shape and "error" not in r]
        floor = next((r["floor_ms"] for r in mine), None)
        lines += [
            f"### {shape} shape (decode-step floor {_fmt(floor)} ms)",
            "",
            "| " + " | ".join(h for _, h in COLUMNS) + " |",
            "|" + "---|" * len(COLUMNS),
        ]
        lines += ["| " + " | ".join(_fmt(r.get(k)) for k, _ in COLUMNS) + " |" for r in mine]
        lines += [
            f"| {r['system']} failed: {r['error']} |"
            for r in rows
            if r["shape"] == shape and "error" in r
        ]
        lines += ["", *ratio_lines(mine), ""]
    return "\n".join(lines)


def ratio_lines(rows: list[dict[str, Any]]) -> list[str]:
    """exlq against its own engine without the queue (e: what the path costs), the stock
    generator (a: what exlq's engine gains), the websocket server and transformers."""
    by = {(r["system"], r["concurrency"]): r for r in rows}
    out = [
        "| N | exlq / engine alone | paired runs: median (range) | exlq added TTFT p50 ms | "
        "exlq / stock generator | exlq / websocket | exlq / transformers |",
        "|---|---|---|---|---|---|---|",
    ]
    for n in sorted({r["concurrency"] for r in rows}):
        exlq = by.get(("exlq", n))
        if exlq is None:
            continue
        engine = by.get(("exlq-engine", n))
        others = (
            engine,
            by.get(("exllamav2-dynamic", n)),
            by.get(("exllamav2-websocket", n)),
            next((r for (s, m), r in by.items() if s.startswith("transformers") and m == n), None),
        )
        ratios = [_ratio(exlq, other) for other in others]
        added = (
            exlq["ttft_ms_p50"] - engine["ttft_ms_p50"]
            if engine and engine.get("ttft_ms_p50") is not None
            else None
        )
        out.append(
            f"| {n} | {ratios[0]} | {paired_ratio(exlq, engine)} | {_fmt(added)} | {ratios[1]} | "
            f"{ratios[2]} | {ratios[3]} |"
        )
    return out


def _ratio(exlq: dict[str, Any], other: dict[str, Any] | None) -> str:
    if not other or not other.get("output_tokens_per_s") or not exlq.get("output_tokens_per_s"):
        return "-"
    return f"{exlq['output_tokens_per_s'] / other['output_tokens_per_s']:.3f}"


def paired_ratio(exlq: dict[str, Any], bare: dict[str, Any] | None) -> str:
    """exlq / bare of runs made back to back (run i of each), which cancels the drift of the
    machine between runs; the median and range of those ratios."""
    if bare is None or exlq.get("runs", 1) < 2 or exlq.get("runs") != bare.get("runs"):
        return "-"
    ratios = [e / b for e, b in zip(exlq["tok_s_runs"], bare["tok_s_runs"], strict=True) if b and e]
    if not ratios:
        return "-"
    return f"{statistics.median(ratios):.3f} ({min(ratios):.2f}-{max(ratios):.2f})"


def merge_files(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Rows and meta of several runs' JSON files (one device call each), as one table: the
    commands are joined; the first file's GPU, bandwidth and date stand for all."""
    rows: list[dict[str, Any]] = []
    metas = []
    for path in paths:
        data = json.loads(path.read_text())
        rows += data["rows"]
        metas.append(data["meta"])
    meta = dict(metas[0])
    meta["command"] = "; ".join(m["command"] for m in metas)
    return rows, meta


def write(rows: list[dict[str, Any]], meta: dict[str, Any], out: Path, tag: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    stem = f"{meta['date']}-{meta['gpu'].replace(' ', '-')}{tag}"
    (out / f"{stem}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    table = markdown(rows, meta)
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shapes", default="1b,8b", help="shape names or model directories")
    ap.add_argument(
        "--systems",
        default="aebcd",
        help="a stock generator, e exlq's engine alone, b exlq, c websocket, d transformers",
    )
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-m", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=1, help="runs of each point, alternating")
    ap.add_argument("--repeat-systems", default="eb", help="systems that repeat")
    ap.add_argument("--ws-window-s", type=float, default=20.0)
    ap.add_argument("--engine-runner", default="process", help="(b): process or thread")
    ap.add_argument(
        "--worker-cpus",
        default="auto",
        help="CPUs of the system under test, e.g. 0-3 (clients and Redis get the rest, less "
        "their SMT siblings), or both sides, e.g. 0-3:4-15. auto: "
        f"{AUTO_SERVER_CPUS} CPUs of distinct cores with {AUTO_MIN_CPUS}+ CPUs; all: no placement",
    )
    add_engine_options(ap)  # (a), (b) and (e); prefill and admission for (b) and (e) only
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="", help="appended to the output files' names")
    ap.add_argument(
        "--merge", nargs="+", type=Path, help="run nothing: one table from these runs' JSON"
    )
    args = ap.parse_args()
    if args.merge:
        write(*merge_files(args.merge), Path(args.out), args.tag)
        return
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    bandwidth = measure_bandwidth()
    place = placement(args.worker_cpus)
    meta = {
        "gpu": gpu_name(),
        "bandwidth_tb_s": bandwidth / 1e12,
        "date": dt.date.today().isoformat(),
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "cache_tokens": args.cache_tokens,
        "cpus": place.describe(),
        "command": "python -m bench.run "
        + " ".join(
            f"--{k.replace('_', '-')} {v if not isinstance(v, list) else ','.join(map(str, v))}"
            for k, v in vars(args).items()
            if k not in ("out", "models", "tag", "merge")
        ),
    }
    rows: list[dict[str, Any]] = []
    for shape in args.shapes.split(","):
        rows += run_shape(shape, args, bandwidth, place)
    write(rows, meta, Path(args.out), args.tag)


if __name__ == "__main__":
    main()

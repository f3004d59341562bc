"""What the exlq path costs, measured in pairs: exlq against its own engine alone, both loaded
once and run alternately, point by point, on the same prompts.

`bench.run` loads the engine alone afresh for each point and runs every point of one
system before the next, so the two runs of a pair are tens of seconds apart, and the drift
of a shared GPU machine over that time is larger than the 3% being measured. Here the
engine alone stays loaded in this process and one `exlq worker` stays up, as in service;
each repeat of a point runs both on the same new prompts, back to back, in alternating
order, and each pair gives one ratio. The CPU of each run's stepping thread is probed
before and after it (bench.cpu_probe), and the summary also reads the pairs at equal CPU
speed: on the virtual machines measured, each CPU's speed moved by up to 2x within seconds.

    python -m bench.paired --shape 1b --concurrency 1,8,32,64,128 --repeats 6
    python -m bench.paired --pool call-1.json call-2.json   # the pairs of several calls
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

from bench import baselines, thread_clock
from bench.cpu_probe import at_equal_speed, probe_each
from bench.exlq_path import (
    ADMIT_PROMPT_TOKENS,
    GPU_EMBEDDING,
    PREFILL_BATCH_TOKENS,
    ExlqPath,
    add_client_options,
    add_engine_options,
    engine_options,
    freeze_loaded_objects,
    worker_options,
)
from bench.gpu_clocks import ClockRecorder, run_figures
from bench.make_checkpoint import model_for
from bench.placement import Placement, on_cpus, placement, stepper_cpu
from bench.run import RESULTS, exlq_attention_patch, gpu_name


class EngineAlone:
    """exlq's engine without the queue, as system (e): the worker's generator class, CUDA
    graphs for 1..max_batch_size jobs, GPU sampling, batched prefill and the admission
    budget, loaded once."""

    def __init__(
        self,
        model_dir: Path,
        max_batch_size: int,
        cache_tokens: int,
        prefill_batch_tokens: int = PREFILL_BATCH_TOKENS,
        admit_prompt_tokens: int = ADMIT_PROMPT_TOKENS,
        gpu_embedding: bool = GPU_EMBEDDING,
    ) -> None:
        importlib.import_module("exllamav2.generator")
        exlq_attention_patch()
        self.model_dir = model_dir
        self.loaded = baselines.exl_load(
            model_dir,
            max_batch_size,
            cache_tokens,
            True,
            None,
            1,  # CPU sampling threads: exlq's engine always runs one
            True,
            prefill_batch_tokens,
            admit_prompt_tokens,
            gpu_embedding,
        )
        self.generator = self.loaded.generator
        # Readied as the worker's engine readies it.
        importlib.import_module("exlq.worker.engines.exllamav2.load").warm_up(self.loaded)

    def run(
        self,
        prompts: list[list[int]],
        warm_up: list[list[int]],
        max_new_tokens: int,
        on_step: baselines.StepClock | None = None,
    ) -> dict[str, Any]:
        """Short jobs on the warm-up prompts first, as (b) runs them through its producer;
        ``on_step`` gets each timed step's begin and end (perf_counter)."""
        baselines.warm_up_jobs(self.generator, warm_up)
        before = thread_clock.snapshot([os.getpid()])
        row = baselines.run_dynamic(
            self.generator,
            self.model_dir,
            prompts,
            max_new_tokens,
            0,
            system="exlq-engine",
            on_step=on_step,
        )
        spent = thread_clock.diff(before, thread_clock.snapshot([os.getpid()]))
        row.update(thread_clock.stepper_figures(spent, row["steps"]))
        return row

    def close(self) -> None:
        self.loaded.unload()


def measure(
    args: argparse.Namespace, place: Placement, model: Path, shape: str
) -> list[dict[str, Any]]:
    biggest = max(args.concurrency)
    runs: list[dict[str, Any]] = []
    system_cpus = place.server or os.sched_getaffinity(0)
    # Both stepping threads on one CPU (--stepper-cpu): each CPU's speed moves on its own,
    # and pairs whose two runs stepped on the same CPU spread less.
    stepper = stepper_cpu(args.stepper_cpu, place)
    engine_cpus = place.server if stepper is None else frozenset({stepper})
    with on_cpus(place.server):
        engine = EngineAlone(model, biggest, **engine_options(args))
    try:
        with (
            ClockRecorder(cpus=place.load) as clocks,
            ExlqPath(
                model,
                max_batch_size=biggest,
                options=worker_options(engine_options(args)),
                worker_cpus=place.server,
                redis_cpus=place.load,
                pack_ids=args.pack_ids,
            ) as path,
        ):
            if args.freeze_gc:
                freeze_loaded_objects()
            if stepper is not None:
                # One untimed run shows which of the engine process's threads steps.
                prompts, warm_up = baselines.pair_prompts(model, 1, args.prompt_tokens, -1)
                with on_cpus(place.load):
                    path.run(prompts, warm_up, args.max_new_tokens)
                path.pin_stepper(stepper)
            for n in args.concurrency:
                for repeat in range(args.repeats):
                    prompts, warm_up = baselines.pair_prompts(model, n, args.prompt_tokens, repeat)
                    order = ("e", "b") if repeat % 2 == 0 else ("b", "e")
                    for system in order:
                        before = probe_each(system_cpus)
                        if system == "e":
                            with on_cpus(engine_cpus):
                                row = engine.run(prompts, warm_up, args.max_new_tokens)
                        else:
                            with on_cpus(place.load):
                                row = path.run(prompts, warm_up, args.max_new_tokens)
                        after = probe_each(system_cpus)
                        row.update(_clock_figures(clocks, row))
                        row.update(
                            cpu_probe_ms=_stepper_probes(row, before, after),
                            cpu_probes_ms={cpu: [before[cpu], after[cpu]] for cpu in before},
                            repeat=repeat,
                            shape=shape,
                        )
                        runs.append(row)
                        print(
                            f"{row['system']} n={n} repeat {repeat}: "
                            f"{row['output_tokens_per_s']:.0f} tok/s, "
                            f"TTFT p50 {row['ttft_ms_p50']:.1f} ms",
                            flush=True,
                        )
    finally:
        engine.close()
    return runs


def _clock_figures(clocks: ClockRecorder, row: dict[str, Any]) -> dict[str, Any]:
    """The GPU's clocks in the idle before a run, up to its median first token (its first
    step) and over the run (bench.gpu_clocks); nothing where NVML cannot be read."""
    t0 = row["started_at"]
    samples = clocks.around(t0)
    return run_figures(samples, t0, row["ttft_ms_p50"], t0 + row["wall_s"]) if samples else {}


def _stepper_note(cpu: int | None) -> str:
    return "" if cpu is None else f"; both systems' stepping threads on CPU {cpu}"


def _stepper_probes(
    row: dict[str, Any], before: dict[int, float], after: dict[int, float]
) -> list[float]:
    """The CPU probes (bench.cpu_probe) around a run, of the CPU its stepping thread ran
    on; the mean over the system's CPUs where that CPU is unknown."""
    cpu = row.get("stepper_cpu")
    if cpu in before and cpu in after:
        return [before[cpu], after[cpu]]
    return [statistics.fmean(before.values()), statistics.fmean(after.values())]


def summarize(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per N: each system's median tok/s, and the pairs' ratios and added TTFT."""
    out = []
    for n in sorted({r["concurrency"] for r in runs}):
        pairs: dict[int, dict[str, dict[str, Any]]] = {}
        for r in runs:
            if r["concurrency"] == n:
                pairs.setdefault(r["repeat"], {})[r["system"]] = r
        whole = [p for p in pairs.values() if "exlq" in p and "exlq-engine" in p]
        if not whole:
            continue
        ratios = [
            p["exlq"]["output_tokens_per_s"] / p["exlq-engine"]["output_tokens_per_s"]
            for p in whole
        ]
        added = [p["exlq"]["ttft_ms_p50"] - p["exlq-engine"]["ttft_ms_p50"] for p in whole]
        added_by_job = [a for a in map(_added_by_job, whole) if a is not None]
        # The engine step's own cost in the worker, apart from the path's fixed latency.
        step_ratios = [
            p["exlq"]["step_ms_mean"] / p["exlq-engine"]["step_ms_mean"]
            for p in whole
            if p["exlq"].get("step_ms_mean") and p["exlq-engine"].get("step_ms_mean")
        ]
        out.append(
            {
                "concurrency": n,
                "pairs": len(whole),
                "engine_tok_s": statistics.median(
                    p["exlq-engine"]["output_tokens_per_s"] for p in whole
                ),
                "exlq_tok_s": statistics.median(p["exlq"]["output_tokens_per_s"] for p in whole),
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
                "ratios": ratios,
                "pairs_at_or_above_0_97": sum(r >= 0.97 for r in ratios),
                "engine_ttft_ms_p50": statistics.median(
                    p["exlq-engine"]["ttft_ms_p50"] for p in whole
                ),
                "added_ttft_ms_median": statistics.median(added),
                "added_ttft_ms": added,
                # Job by job: a pair's median of each job's TTFT in exlq less the same job's in
                # the engine alone. The p50s' difference moves by half a prefill slice when one
                # job's first token is held back (partial UTF-8) in one system and not the
                # other; this does not. None for files from before per-job times.
                "added_ttft_by_job_ms": added_by_job,
                "added_ttft_by_job_ms_median": (
                    statistics.median(added_by_job) if added_by_job else None
                ),
                # Pairs whose two runs held back the first tokens of different jobs; None
                # where the runs do not count their first events' tokens.
                **_held_apart(whole),
                "step_ratio_median": statistics.median(step_ratios) if step_ratios else None,
                # Inside the engine's TTFT since its clock starts before it builds its jobs
                # (baselines.run_dynamic); older results started it after.
                "engine_build_ms_median": statistics.median(
                    p["exlq-engine"].get("build_ms", 0.0) for p in whole
                ),
                **_at_equal_speed(whole, ratios),
                # How far each paired median could move with other pairs of the same spread.
                "intervals": {
                    "ratio": median_interval(ratios),
                    "added_ttft_ms": median_interval(added),
                    "added_ttft_by_job_ms": median_interval(added_by_job),
                },
                # The GPU's clocks around each system's runs (bench.gpu_clocks).
                "gpu_clocks": {
                    f"{system}_{key}": _median_of(whole, system, key)
                    for system in ("exlq-engine", "exlq")
                    for key in CLOCK_FIGURES
                },
                "gpu_clock_reasons": sorted(
                    {
                        name
                        for p in whole
                        for r in p.values()
                        for name in r.get("gpu_clock_reasons", [])
                    }
                ),
                # Where each system's stepping thread spent a step (bench.thread_clock).
                "threads": {
                    f"{system}_{key}": _median_of(whole, system, key)
                    for system in ("exlq-engine", "exlq")
                    for key in THREAD_FIGURES
                },
            }
        )
    return out


# Bootstrap intervals of the paired medians: this many resamples, this seed (a file's
# intervals are the same each time it is summarized or pooled), these percentiles.
RESAMPLES = 4000
INTERVAL_SEED = 1
INTERVAL = (5.0, 95.0)


def median_interval(values: list[float]) -> tuple[float, float] | None:
    """The 90% bootstrap interval of the median of ``values``: the 5th and 95th percentiles
    of the medians of RESAMPLES resamples drawn with replacement. None for fewer than two."""
    if len(values) < 2:
        return None
    rng = random.Random(INTERVAL_SEED)
    medians = [statistics.median(rng.choices(values, k=len(values))) for _ in range(RESAMPLES)]
    lo, hi = baselines.percentiles(medians, INTERVAL)
    assert lo is not None and hi is not None
    return lo, hi


def _added_by_job(pair: dict[str, dict[str, Any]]) -> float | None:
    """The median over a pair's jobs of exlq's TTFT less the engine alone's for the same
    job (both runs take the same prompts in the same order); None without per-job times."""
    exlq, engine = pair["exlq"].get("ttft_ms_jobs"), pair["exlq-engine"].get("ttft_ms_jobs")
    if not exlq or not engine or len(exlq) != len(engine):
        return None
    added = [b - e for b, e in zip(exlq, engine, strict=True) if b is not None and e is not None]
    return statistics.median(added) if added else None


def _held_apart(pairs: list[dict[str, dict[str, Any]]]) -> dict[str, int | None]:
    """How many pairs had a job whose first event carried more than one token (its text held
    back) in one run and not in the other, of the pairs whose runs both count them."""
    counted = [
        (p["exlq"]["first_event_tokens"], p["exlq-engine"]["first_event_tokens"])
        for p in pairs
        if p["exlq"].get("first_event_tokens") and p["exlq-engine"].get("first_event_tokens")
    ]
    if not counted:
        return {"pairs_held_apart": None, "pairs_counting_held": None}
    apart = sum(
        any(((b or 0) > 1) != ((e or 0) > 1) for b, e in zip(exlq, engine, strict=True))
        for exlq, engine in counted
    )
    return {"pairs_held_apart": apart, "pairs_counting_held": len(counted)}


# Pairs whose two runs' CPU probes agree within this factor count as matched.
MATCHED_SPEED = 1.10


def _probe(run: dict[str, Any]) -> float | None:
    probes = run.get("cpu_probe_ms")
    return statistics.fmean(probes) if probes else None


def _at_equal_speed(pairs: list[dict[str, dict[str, Any]]], ratios: list[float]) -> dict[str, Any]:
    """The pairs' figures where both runs met the same CPU speed (bench.cpu_probe): fitted
    over every pair with probes, and the median of the pairs whose probes agree within
    MATCHED_SPEED. None where the runs carry no probes (files from before them)."""
    speeds: list[float] = []
    tok_ratios: list[float] = []
    ttft_ratios: list[float] = []
    for pair, ratio in zip(pairs, ratios, strict=True):
        engine, exlq = _probe(pair["exlq-engine"]), _probe(pair["exlq"])
        if engine and exlq:
            speeds.append(exlq / engine)
            tok_ratios.append(ratio)
            ttft_ratios.append(pair["exlq"]["ttft_ms_p50"] / pair["exlq-engine"]["ttft_ms_p50"])
    matched = [
        r
        for r, s in zip(tok_ratios, speeds, strict=True)
        if 1 / MATCHED_SPEED <= s <= MATCHED_SPEED
    ]
    ttft_ratio = at_equal_speed(ttft_ratios, speeds)
    engine_ttft = statistics.median(p["exlq-engine"]["ttft_ms_p50"] for p in pairs)
    return {
        "cpu_speed_ratios": speeds,
        "ratio_at_equal_speed": at_equal_speed(tok_ratios, speeds),
        "added_ttft_ms_at_equal_speed": (
            None if ttft_ratio is None else engine_ttft * (ttft_ratio - 1.0)
        ),
        "matched_pairs": len(matched),
        "ratio_median_matched": statistics.median(matched) if matched else None,
    }


CLOCK_FIGURES = ("gpu_sm_mhz_idle", "gpu_sm_mhz_first", "gpu_sm_mhz_run", "gpu_power_w_run")
THREAD_FIGURES = (
    "stepper_run_us_per_step",
    "stepper_wait_us_per_step",
    "stepper_preempted_per_step",
    "others_run_us_per_step",
)


def _median_of(pairs: list[dict[str, dict[str, Any]]], system: str, key: str) -> float | None:
    values = [p[system][key] for p in pairs if p[system].get(key) is not None]
    return statistics.median(values) if values else None


def markdown(summary: list[dict[str, Any]], meta: dict[str, Any]) -> str:
    lines = [
        f"GPU: {meta['gpu']}; {meta['date']}; {meta['shape']} shape; prompt "
        f"{meta['prompt_tokens']} tokens, {meta['max_new_tokens']} new tokens, EOS ignored, "
        f"greedy; cache {meta['cache_tokens']} tokens; CPUs: {meta['cpus']}. Each pair runs "
        "the engine alone and exlq back to back on the same new prompts, in alternating order. "
        "Added TTFT job by job: each pair's median over its jobs of the job's TTFT in exlq "
        "less the same job's in the engine alone.",
        f"Command: `{meta['command']}`",
        "",
        "| N | pairs | engine alone tok/s | exlq tok/s | exlq / engine, paired median "
        "(range) | pairs >= 0.97 | engine TTFT p50 ms | of which building its jobs, ms | "
        "added TTFT p50 ms, median | added TTFT job by job ms, median | exlq / engine step "
        "time, paired median |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        lines.append(
            f"| {s['concurrency']} | {s['pairs']} | {s['engine_tok_s']:,.0f} | "
            f"{s['exlq_tok_s']:,.0f} | {s['ratio_median']:.3f} ({s['ratio_min']:.2f}-"
            f"{s['ratio_max']:.2f}) | {s['pairs_at_or_above_0_97']} of {s['pairs']} | "
            f"{s['engine_ttft_ms_p50']:.1f} | {s['engine_build_ms_median']:.1f} | "
            f"{s['added_ttft_ms_median']:.1f} | {_num(s.get('added_ttft_by_job_ms_median'), 1)} | "
            + (f"{s['step_ratio_median']:.3f} |" if s["step_ratio_median"] else "- |")
        )
    lines += _interval_lines(summary)
    lines += _held_lines(summary)
    if any(s.get("ratio_at_equal_speed") is not None for s in summary):
        lines += [
            "",
            "At equal CPU speed (bench.cpu_probe: the same Python work timed on the CPU of "
            "each run's stepping thread, before and after the run; this machine's CPU speed "
            "varies from second to second). Fitted: each pair's log ratio against the log "
            "ratio of its runs' "
            f"probes, read where they agree. Matched: the pairs whose probes agree within "
            f"{MATCHED_SPEED - 1:.0%}.",
            "",
            "| N | exlq / engine, fitted | added TTFT p50 ms, fitted | matched pairs | "
            "exlq / engine, matched median | exlq CPU / engine CPU probe, paired median |",
            "|---|---|---|---|---|---|",
        ]
        for s in summary:
            speeds = s.get("cpu_speed_ratios") or []
            lines.append(
                f"| {s['concurrency']} | {_num(s.get('ratio_at_equal_speed'), 3)} | "
                f"{_num(s.get('added_ttft_ms_at_equal_speed'), 1)} | "
                f"{s.get('matched_pairs', 0)} of {len(speeds)} | "
                f"{_num(s.get('ratio_median_matched'), 3)} | "
                f"{_num(statistics.median(speeds) if speeds else None, 3)} |"
            )
    if any(s.get("threads", {}).get("exlq_stepper_run_us_per_step") for s in summary):
        lines += [
            "",
            "The stepping thread per step, paired medians (µs on a CPU / µs waiting for one / "
            "preemptions), and the CPU time of every other thread of the system under test "
            "(µs per step):",
            "",
            "| N | engine alone: run / wait / preempted | others | exlq: run / wait / "
            "preempted | others (worker + engine process) |",
            "|---|---|---|---|---|",
        ]
        for s in summary:
            t = s.get("threads", {})
            lines.append(
                f"| {s['concurrency']} | {_thread_cell(t, 'exlq-engine')} | "
                f"{_num(t.get('exlq-engine_others_run_us_per_step'))} | "
                f"{_thread_cell(t, 'exlq')} | {_num(t.get('exlq_others_run_us_per_step'))} |"
            )
    lines += _clock_lines(summary)
    return "\n".join(lines)


def _interval_lines(summary: list[dict[str, Any]]) -> list[str]:
    if not any(s.get("intervals") for s in summary):
        return []
    lines = [
        "",
        f"90% bootstrap intervals of the paired medians ({RESAMPLES:,} resamples of each "
        f"point's pairs, seed {INTERVAL_SEED}):",
        "",
        "| N | pairs | exlq / engine | added TTFT p50 ms | added TTFT job by job ms |",
        "|---|---|---|---|---|",
    ]
    for s in summary:
        i = s.get("intervals") or {}
        lines.append(
            f"| {s['concurrency']} | {s['pairs']} | {_span(i.get('ratio'), 3)} | "
            f"{_span(i.get('added_ttft_ms'), 1)} | {_span(i.get('added_ttft_by_job_ms'), 1)} |"
        )
    return lines


def _held_lines(summary: list[dict[str, Any]]) -> list[str]:
    held = [s for s in summary if s.get("pairs_counting_held")]
    if not held:
        return []
    counts = "; ".join(
        f"N={s['concurrency']}: {s['pairs_held_apart']} of {s['pairs_counting_held']}" for s in held
    )
    return [
        "",
        "Pairs whose runs held back the first tokens of different jobs (a first event of more "
        "than one token: partial UTF-8 text held back; such a job in a burst's first slice "
        f"moves the TTFT p50 of a burst of several slices by half a slice): {counts}.",
    ]


def _span(interval: list[float] | tuple[float, float] | None, digits: int) -> str:
    return "-" if not interval else f"{interval[0]:.{digits}f} to {interval[1]:.{digits}f}"


def _clock_lines(summary: list[dict[str, Any]]) -> list[str]:
    if not any(s.get("gpu_clocks", {}).get("exlq_gpu_sm_mhz_run") for s in summary):
        return []
    lines = [
        "",
        "The GPU's SM clock (NVML, bench.gpu_clocks; MHz, medians of the runs' medians): in "
        "the 0.09 s idle before a burst, from its start to its median first token (the "
        "first step), over the run; and the board's power over the run (W):",
        "",
        "| N | engine alone: idle / first step / run | W | exlq: idle / first step / run | W "
        "| NVML's reasons for lower clocks |",
        "|---|---|---|---|---|---|",
    ]
    for s in summary:
        c = s.get("gpu_clocks", {})
        cells = [
            " / ".join(_num(c.get(f"{system}_{key}")) for key in CLOCK_FIGURES[:3])
            + f" | {_num(c.get(f'{system}_gpu_power_w_run'))}"
            for system in ("exlq-engine", "exlq")
        ]
        reasons = ", ".join(s.get("gpu_clock_reasons", [])) or "-"
        lines.append(f"| {s['concurrency']} | {cells[0]} | {cells[1]} | {reasons} |")
    return lines


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _thread_cell(threads: dict[str, float | None], system: str) -> str:
    return (
        f"{_num(threads.get(f'{system}_stepper_run_us_per_step'))} / "
        f"{_num(threads.get(f'{system}_stepper_wait_us_per_step'))} / "
        f"{_num(threads.get(f'{system}_stepper_preempted_per_step'), 2)}"
    )


def pool(paths: list[Path]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The runs of several result files of one shape and code, as one set of pairs (each
    file's repeats kept apart), and the first file's meta with every file's command."""
    runs: list[dict[str, Any]] = []
    metas = []
    for index, path in enumerate(paths):
        data = json.loads(path.read_text())
        metas.append(data["meta"])
        for run in data["runs"]:
            runs.append(run | {"repeat": index * 1000 + run["repeat"]})
    if len({m["shape"] for m in metas}) != 1:
        raise SystemExit("--pool: the files hold different shapes; pool one shape at a time")
    meta = dict(metas[0])
    meta["command"] = "; ".join(m["command"] for m in metas) + (
        f" (pooled: python -m bench.paired --pool {' '.join(p.name for p in paths)})"
    )
    return runs, meta


def write(runs: list[dict[str, Any]], meta: dict[str, Any], out: Path, stem: str) -> None:
    summary = summarize(runs)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(
        json.dumps({"meta": meta, "summary": summary, "runs": runs}, indent=2)
    )
    table = markdown(summary, meta)
    (out / f"{stem}.md").write_text(table + "\n")
    print(table)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument(
        "--pool",
        nargs="+",
        type=Path,
        metavar="JSON",
        help="measure nothing: summarize the pairs of these result files together",
    )
    ap.add_argument(
        "--shape",
        default="1b",
        help="a random-weight shape (1b or 8b) or a model directory (an EXL2 conversion, say)",
    )
    ap.add_argument("--concurrency", default="1,8,32,64,128")
    ap.add_argument("--repeats", type=int, default=6, help="pairs at each concurrency")
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-m", "--max-new-tokens", type=int, default=128)
    add_engine_options(ap)  # both systems alike
    add_client_options(ap)
    ap.add_argument("--worker-cpus", default="auto", help="as for bench.run")
    ap.add_argument(
        "--stepper-cpu",
        default="auto",
        help="the one CPU both systems' stepping threads run on (auto: the last of the "
        "system's CPUs; none: where the scheduler puts them)",
    )
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--out", default=str(RESULTS))
    ap.add_argument("--tag", default="")
    args = ap.parse_args()
    if args.pool:
        runs, meta = pool(args.pool)
        write(runs, meta, Path(args.out), f"{meta['date']}-paired-{meta['shape']}-pooled{args.tag}")
        return
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    place = placement(args.worker_cpus)
    model, shape = model_for(args.shape, Path(args.models))
    meta = {
        "gpu": gpu_name(),
        "date": dt.date.today().isoformat(),
        "shape": shape,
        "prompt_tokens": args.prompt_tokens,
        "max_new_tokens": args.max_new_tokens,
        "cache_tokens": args.cache_tokens,
        "cpus": place.describe() + _stepper_note(stepper_cpu(args.stepper_cpu, place)),
        "command": f"python -m bench.paired --shape {args.shape} --concurrency "
        f"{','.join(map(str, args.concurrency))} --repeats {args.repeats}"
        + ("" if args.freeze_gc else " --no-freeze-gc")
        + (" --pack-ids" if args.pack_ids else "")
        + ("" if args.stepper_cpu == "auto" else f" --stepper-cpu {args.stepper_cpu}")
        + (
            ""
            if args.admit_prompt_tokens == ADMIT_PROMPT_TOKENS
            else f" --admit-prompt-tokens {args.admit_prompt_tokens}"
        ),
    }
    started = time.monotonic()
    runs = measure(args, place, model, shape)
    meta["seconds"] = round(time.monotonic() - started)
    stem = f"{meta['date']}-{meta['gpu'].replace(' ', '-')}-paired-{meta['shape']}{args.tag}"
    write(runs, meta, Path(args.out), stem)


if __name__ == "__main__":
    main()

"""Where a burst's time goes on the exlq path, beside the engine alone: one timeline a run.

    python -m bench.path_trace --shape 1b --concurrency 8,128 --repeats 2 --out DIR

The two systems run as in `bench.paired` (the engine alone in this process, one
`exlq worker` kept up, the same new prompts for both, back to back, in turn). The worker
runs with EXLQ_TRACE_FILE set (exlq.worker.tracing): both of its processes append each
stage of a job's path to DIR/trace-SHAPE.jsonl. The engine alone's steps and every job's
first token are recorded in this process. Every time is `perf_counter()`, which on Linux
is CLOCK_MONOTONIC, one clock for every process of the machine.

A stage costs a few µs when traced, so a traced run is not a measurement of the path's
cost: `bench.paired` is. This says where in the run the difference between the two sits.
`--table RESULT.json` prints the stage table of a result again.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from bench.gpu_clocks import IDLE_WINDOW_S, ClockRecorder, run_figures
from bench.gpu_clocks import timeline as timeline_of
from exlq.worker import tracing

if TYPE_CHECKING:
    from bench.exlq_path import ExlqPath
    from bench.paired import EngineAlone
    from bench.placement import Placement

Record = dict[str, Any]


def _ms(t: float, t0: float) -> float:
    return round((t - t0) * 1000, 2)


def slice_jobs(admit_prompt_tokens: int, prompt_tokens: int, jobs: int) -> int:
    """Jobs in one admission slice: the budget's worth of prompts (0: no budget, one slice)."""
    return max(1, admit_prompt_tokens // prompt_tokens) if admit_prompt_tokens else jobs


def group_medians(first_ms: Sequence[float | None], group: int) -> list[float]:
    """The median first-token time (ms after the burst's start) of each group of ``group``
    jobs (one admission slice), in submit order; jobs that made no token left out."""
    medians = []
    for g in range(0, len(first_ms), group):
        made = [t for t in first_ms[g : g + group] if t is not None]
        if made:
            medians.append(round(statistics.median(made), 2))
    return medians


def read_trace(path: Path, t0: float, t_end: float) -> list[Record]:
    """The worker's stages (both processes) between t0 and t_end, in time order."""
    records = [json.loads(line) for line in path.read_text().splitlines()]
    return sorted((r for r in records if t0 <= r["t"] <= t_end), key=lambda r: float(r["t"]))


def exlq_timeline(records: list[Record], t0: float, steps_shown: int) -> Record:
    """A run's stages as ms after t0 (lists cut to what a reader looks at)."""

    def at(stage: tracing.Stage) -> list[Record]:
        return [r for r in records if r["stage"] == stage]

    def ms(r: Record, key: str = "t") -> float:
        return _ms(r[key], t0)

    engine_pids = {r["pid"] for r in at("step_begun")}
    steps = [
        [ms(begun), ms(ended), begun["active"]]
        for begun, ended in zip(at("step_begun"), at("step_ended"), strict=False)
    ]
    return {
        # the worker's event loop
        "pieces_begun": [[ms(r), r["n"]] for r in at("piece_begun")],
        "parses": [ms(r) for r in at("job_parsed")][:8],
        "offers_sent": [[ms(r), r["n"]] for r in at("offer_sent")][:16],
        "admits_sent": [[ms(r), r["n"]] for r in at("admit_sent")],
        # the start script answered for a piece (the admit above may come before it)
        "pieces_started": [[ms(r), r["n"]] for r in at("piece_started")],
        # the engine process
        "commands_read": [[ms(r), r["kind"]] for r in at("command_read")][:16],
        "offers_prepared": [[ms(r), r["n"]] for r in at("offer_prepared")][:16],
        "jobs_added": [[ms(r), r["n"]] for r in at("jobs_added")],
        "builds_ahead": [ms(r) for r in at("built_ahead")][:16],
        "steps": steps[:steps_shown],
        # each report's send, and how long it waited after its step (for the next GPU wait)
        "reports_sent": [[ms(r), round(r["held_ms"], 3)] for r in at("report_sent")][:steps_shown],
        # the way back, on the worker's event loop
        "reports_received": [ms(r) for r in at("report_received")][:steps_shown],
        "commits_begun": [ms(r) for r in at("commit_begun")][: steps_shown + 4],
        "commits_ended": [ms(r) for r in at("commit_ended")][: steps_shown + 4],
        # collections of 1 ms or more: [start ms, ms, generation, which process]
        "worker_gc": [
            [
                ms(r, "begin"),
                _ms(r["t"], r["begin"]),
                r["generation"],
                "engine" if r["pid"] in engine_pids else "worker",
            ]
            for r in at("collected")
        ],
    }


def _first_admit_read(r: Record) -> float:
    return float(next(t for t, kind in r["commands_read"] if kind in ("admit", "add")))


def _commit_begun(r: Record) -> float:
    """When the commit of the first step's report began: the last commit begun before the
    first commit end after that report reached the worker."""
    received = r["reports_received"][0]
    end = min(t for t in r["commits_ended"] if t >= received)
    return float(max(t for t in r["commits_begun"] if received <= t <= end))


def _before_admit(r: Record, what: str) -> float:
    """The last offer prepared ("offers") or build ahead ("builds") before the first
    piece's jobs were added; ValueError if there was none."""
    added = r["jobs_added"][0][0]
    times = [t for t, _ in r["offers_prepared"]] if what == "offers" else r["builds_ahead"]
    return float(max(t for t in times if t <= added))


# The first piece's way through exlq, and its first token's way back: (label, the ms of a
# run's timeline it reads).
STAGES: list[tuple[str, Callable[[Record], float]]] = [
    ("the worker starts on the first piece", lambda r: r["pieces_begun"][0][0]),
    ("it has parsed the first job", lambda r: r["parses"][0]),
    ("it offers the first job to the engine process", lambda r: r["offers_sent"][0][0]),
    ("it admits the piece (the hand-over)", lambda r: r["admits_sent"][0][0]),
    ("the engine process reads the admit", _first_admit_read),
    ("the engine has prepared the offers before it", lambda r: _before_admit(r, "offers")),
    # none when the last offer and the admit reached the engine together
    ("the idle engine has built ahead", lambda r: _before_admit(r, "builds")),
    ("the engine has added the piece's jobs", lambda r: r["jobs_added"][0][0]),
    ("the start script answers", lambda r: r["pieces_started"][0][0]),
    ("the first step begins", lambda r: r["steps"][0][0]),
    ("the first step ends", lambda r: r["steps"][0][1]),
    ("the engine process sends its report", lambda r: r["reports_sent"][0][0]),
    ("its report reaches the worker's event loop", lambda r: r["reports_received"][0]),
    ("the worker calls the commit script", _commit_begun),
    ("its events are in Redis (the script returns)", lambda r: r["commits_ended"][0]),
    ("the median job's first token reaches the client", lambda r: r["first_token_by_group"][0]),
]


def stage_table(runs: list[Record]) -> str:
    """Markdown: the median ms after the burst's start of each stage, per burst size, and
    the engine alone's first step beside it."""
    sizes = sorted({r["n"] for r in runs})
    exlq = {n: [r for r in runs if r["n"] == n and r["system"] == "exlq"] for n in sizes}
    alone = {n: [r for r in runs if r["n"] == n and r["system"] == "exlq-engine"] for n in sizes}

    def cell(rows: list[Record], read: Callable[[Record], float]) -> str:
        values = []
        for r in rows:
            try:
                values.append(read(r))
            except (IndexError, KeyError, ValueError, StopIteration):
                continue
        return f"{statistics.median(values):.2f}" if values else "-"

    lines = [
        "| stage (ms after the burst's first submit, median of the runs) | "
        + " | ".join(f"{n} jobs ({len(exlq[n])} runs)" for n in sizes)
        + " |",
        "|---" * (len(sizes) + 1) + "|",
    ]
    for label, read in STAGES:
        lines.append(f"| exlq: {label} | " + " | ".join(cell(exlq[n], read) for n in sizes) + " |")
    for label, read in [
        ("engine alone: its jobs built, the first step begins", lambda r: r["steps"][0][0]),
        ("engine alone: the first step ends", lambda r: r["steps"][0][1]),
        ("engine alone: the median job's first token", lambda r: r["first_token_by_group"][0]),
    ]:
        lines.append(f"| {label} | " + " | ".join(cell(alone[n], read) for n in sizes) + " |")
    return "\n".join(lines)


class TracedSystems:
    """Runs one burst on each system and turns what was recorded into its timeline."""

    def __init__(
        self,
        args: argparse.Namespace,
        place: Placement,
        trace: Path,
        engine: EngineAlone | None,
        path: ExlqPath,
        clocks: ClockRecorder,
    ) -> None:
        self.args, self.place, self.trace = args, place, trace
        self.engine, self.path, self.clocks = engine, path, clocks
        # This process's own collections of a millisecond or more (the SDK's clients run
        # here), through the worker's collection clock.
        self.collections = tracing.Recorder()
        self._clock = tracing.CollectionClock(self.collections)

    def __enter__(self) -> TracedSystems:
        gc.callbacks.append(self._clock)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self._clock)

    def all(self) -> list[Callable[[list[list[int]], list[list[int]]], Record]]:
        return [self.run_engine, self.run_exlq]

    def _group(self, jobs: int) -> int:
        return slice_jobs(self.args.admit_prompt_tokens, self.args.prompt_tokens, jobs)

    def _bench_gc(self, t0: float) -> list[list[float]]:
        """This process's collections since t0: [start ms, ms, generation]."""
        spans = [
            (float(f["begin"]), t, float(f["generation"])) for t, _, f in self.collections.records
        ]
        return [[_ms(begin, t0), _ms(end, begin), gen] for begin, end, gen in spans if begin >= t0]

    def run_engine(self, prompts: list[list[int]], warm_up: list[list[int]]) -> Record:
        from bench.placement import on_cpus

        assert self.engine is not None
        steps: list[tuple[float, float]] = []
        with on_cpus(self.place.server):
            row = self.engine.run(
                prompts,
                warm_up,
                self.args.max_new_tokens,
                on_step=lambda begin, end: steps.append((begin, end)),
            )
        t0 = row["started_at"]
        shown = [[_ms(a, t0), _ms(b, t0)] for a, b in steps[: self.args.steps_shown]]
        return self._clocks(t0, shown) | {
            "system": "exlq-engine",
            "ttft_ms_p50": row["ttft_ms_p50"],
            "build_ms": row["build_ms"],
            "bench_gc": self._bench_gc(t0),
            "steps": shown,
            "first_token_by_group": group_medians(row["ttft_ms_jobs"], self._group(len(prompts))),
        }

    def run_exlq(self, prompts: list[list[int]], warm_up: list[list[int]]) -> Record:
        from bench.placement import on_cpus

        with on_cpus(self.place.load):
            row = self.path.run(prompts, warm_up, self.args.max_new_tokens)
        t0 = row["started_at"]
        records = read_trace(self.trace, t0, t0 + row["wall_s"])
        timeline = exlq_timeline(records, t0, self.args.steps_shown)
        return self._clocks(t0, timeline["steps"]) | {
            "system": "exlq",
            "ttft_ms_p50": row["ttft_ms_p50"],
            "first_token_by_group": group_medians(row["ttft_ms_jobs"], self._group(len(prompts))),
            "bench_gc": self._bench_gc(t0),
            **timeline,
        }

    def _clocks(self, t0: float, steps: list[list[float]]) -> Record:
        """The GPU's clocks (bench.gpu_clocks) from the idle before the burst to the end of
        its shown steps: [ms after t0, SM MHz, memory MHz, W, NVML reasons] each sample."""
        end = t0 + (steps[-1][1] if steps else 0.0) / 1000
        samples = self.clocks.around(t0)
        if not samples:
            return {}
        first_ms = steps[0][1] if steps else 0.0
        return run_figures(samples, t0, first_ms, end) | {
            "gpu_clocks": timeline_of(samples, t0, t0 - IDLE_WINDOW_S, end)
        }


def measure(args: argparse.Namespace, model: Path, shape: str) -> list[Record]:
    from bench import baselines
    from bench.exlq_path import ExlqPath, engine_options, freeze_loaded_objects, worker_options
    from bench.paired import EngineAlone
    from bench.placement import on_cpus, placement

    concurrencies = [int(n) for n in args.concurrency.split(",")]
    place = placement(args.worker_cpus)
    args.out.mkdir(parents=True, exist_ok=True)
    trace = args.out / f"trace-{shape}.jsonl"
    trace.unlink(missing_ok=True)
    runs: list[Record] = []
    with on_cpus(place.server):
        engine = EngineAlone(model, max(concurrencies), **engine_options(args))
    if args.freeze_gc:
        freeze_loaded_objects()
    try:
        with (
            ClockRecorder(cpus=place.load) as clocks,
            ExlqPath(
                model,
                max_batch_size=max(concurrencies),
                options=worker_options(engine_options(args)),
                worker_cpus=place.server,
                redis_cpus=place.load,
                trace_file=trace,
                pack_ids=args.pack_ids,
            ) as path,
            TracedSystems(args, place, trace, engine, path, clocks) as traced,
        ):
            systems = traced.all()
            for n in concurrencies:
                for repeat in range(args.repeats):
                    prompts, warm_up = baselines.pair_prompts(model, n, args.prompt_tokens, repeat)
                    # In turn, as bench.paired: the second of a pair runs on a warmer GPU.
                    turn = repeat % len(systems)
                    for run_system in systems[turn:] + systems[:turn]:
                        runs.append(run_system(prompts, warm_up) | {"n": n, "repeat": repeat})
                        print(json.dumps(runs[-1]), flush=True)
    finally:
        engine.close()
    return runs


def main() -> None:
    from bench.exlq_path import add_client_options, add_engine_options

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--concurrency", default="8,128")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-m", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--steps-shown", type=int, default=8)
    add_engine_options(ap)
    add_client_options(ap)
    ap.add_argument("--worker-cpus", default="auto", help="as for bench.run")
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--out", type=Path, help="folder for the timelines and the trace file")
    ap.add_argument(
        "--table", type=Path, metavar="JSON", help="measure nothing: the stage table of a result"
    )
    args = ap.parse_args()
    if args.table:
        print(stage_table(json.loads(args.table.read_text())))
        return
    if args.out is None:
        raise SystemExit("--out is required to measure")
    from bench.make_checkpoint import model_for

    model, shape = model_for(args.shape, Path(args.models))
    runs = measure(args, model, shape)
    (args.out / f"path-trace-{shape}.json").write_text(json.dumps(runs, indent=1))
    print(stage_table(runs))


if __name__ == "__main__":
    main()

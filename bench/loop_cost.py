"""What the worker's engine loop costs its stepping thread, with no queue around it.

The engine process runs its engine on an EngineLoop: commands in, each pass's report
encoded and written to the worker's pipe, and the loop's own work run inside a step's wait
for the device. Here one engine, loaded once, runs bursts of jobs in turn, on one CPU, on
new prompts each run:

- ``loop``: an EngineLoop as the engine process runs it, each report encoded and written
  to a pipe (a `cat` process reads it);
- ``bare``: the same engine's add() and step() in a plain loop, no reports;
- ``generator`` (exllamav2 only): its generator iterated alone, as bench.paired's engine
  alone runs it.

For the loop it reports what share of its wall time went beyond engine.step()'s own work
(the loop's bookkeeping and its work in the wait, of which writing reports), and, for
exllamav2, the share engine.step() spent outside its generator (results made into
TokenChunks). Where the step waits for the device, that work hides in the wait; where the
host is the step's bound (the 1B shape at many jobs), it adds to every step.

    python -m bench.loop_cost --shape 1b --concurrency 8,64 --repeats 6
    python -m bench.loop_cost --engine echo --concurrency 8 --repeats 2   # no GPU
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import multiprocessing
import os
import random
import statistics
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.exlq_path import add_engine_options, engine_options, worker_options
from bench.placement import on_cpus
from exlq.protocol.models import GenerationRequest, Sampling
from exlq.worker.engine_loop import EngineLoop, StepReport
from exlq.worker.engine_process import encode_report
from exlq.worker.engines import build_engine
from exlq.worker.engines.base import Engine, EngineOutput, JobEnded, JobErrored
from exlq.worker.gc_pauses import HeldCollections, freeze_startup_heap
from exlq.worker.settings import WorkerSettings

IDLE_BEFORE_RUN_S = 0.1  # as bench.paired's runs: the engine idles first
RUN_TIMEOUT_S = 120.0
Row = dict[str, Any]


@dataclass
class Clocks:
    """Seconds spent in each part of a loop's run, and the steps it took."""

    step_s: float = 0.0  # in engine.step()
    iterate_s: float = 0.0  # in the exllamav2 generator's iterate(), inside step
    wait_s: float = 0.0  # in the loop's wait work, inside iterate
    sink_s: float = 0.0  # encoding and writing reports, in the wait or after a step
    steps: int = 0

    def reset(self) -> None:
        self.step_s = self.iterate_s = self.wait_s = self.sink_s = 0.0
        self.steps = 0


class _TimedLoop(EngineLoop):
    """An EngineLoop whose work in the device's wait is timed."""

    def __init__(self, engine: Engine, clocks: Clocks) -> None:
        super().__init__(engine, HeldCollections())
        self._clocks = clocks

    def _in_wait(self) -> None:
        started = time.perf_counter()
        super()._in_wait()
        self._clocks.wait_s += time.perf_counter() - started


class PipeSink:
    """Writes each report as the engine process does (encode_report, then send_bytes on a
    pipe, which a `cat` process drains) and counts the jobs that end."""

    def __init__(self, clocks: Clocks) -> None:
        self._clocks = clocks
        reader, self._writer = multiprocessing.Pipe(duplex=False)
        self._drain = subprocess.Popen(
            ["cat"], stdin=reader.fileno(), stdout=subprocess.DEVNULL, close_fds=True
        )
        reader.close()
        self.done = threading.Event()
        self.left = 0
        self.tokens = 0
        self.ended_at = 0.0

    def expect(self, jobs: int) -> None:
        self.left, self.tokens = jobs, 0
        self.done.clear()

    def __call__(self, report: StepReport) -> None:
        started = time.perf_counter()
        self._writer.send_bytes(encode_report(report))
        self._clocks.sink_s += time.perf_counter() - started
        jobs, tokens = endings(report.outputs)
        self.left -= jobs
        self.tokens += tokens
        if self.left <= 0 and not self.done.is_set():
            self.ended_at = time.perf_counter()
            self.done.set()

    def close(self) -> None:
        self._writer.close()
        self._drain.wait(10)


def endings(outputs: Sequence[EngineOutput]) -> tuple[int, int]:
    """How many jobs these outputs end (done or failed), and the tokens of those done."""
    ends = [o for o in outputs if isinstance(o, (JobEnded, JobErrored))]
    return len(ends), sum(o.completion_tokens for o in ends if isinstance(o, JobEnded))


def timed(call: Callable[[], Any], add: Callable[[float], None]) -> Callable[[], Any]:
    """`call`, with the seconds each call takes handed to `add`."""

    def wrapper() -> Any:
        started = time.perf_counter()
        try:
            return call()
        finally:
            add(time.perf_counter() - started)

    return wrapper


def requests_for(prompts: list[list[int]], max_new_tokens: int) -> list[GenerationRequest]:
    return [
        GenerationRequest(
            input_ids=ids,
            max_new_tokens=max_new_tokens,
            ignore_eos=True,
            sampling=Sampling(temperature=0.0),
        )
        for ids in prompts
    ]


def prompts_for(model: Path | None, n: int, tokens: int, seed: int) -> list[list[int]]:
    """n new prompts: the model's ordinary token ids (bench.baselines), or, for an engine
    without a model, ids from a fixed range."""
    if model is None:
        rng = random.Random(f"loop-cost/{seed}/{n}")
        return [[rng.randrange(1_000, 30_000) for _ in range(tokens)] for _ in range(n)]
    from bench.baselines import random_prompt_ids

    return random_prompt_ids(model, n, tokens, seed)


class LoopCost:
    """One engine, loaded once, and the three ways of running it."""

    def __init__(self, engine: Engine, model: Path | None, max_new_tokens: int) -> None:
        self.engine = engine
        self.model = model
        self.max_new_tokens = max_new_tokens
        self.clocks = Clocks()
        self.sink = PipeSink(self.clocks)
        self.generator: Any = getattr(engine, "generator", None)
        # The engine's step, and its generator's iterate() within it, timed in place.
        engine.step = timed(engine.step, self._add_step)  # type: ignore[method-assign]
        if self.generator is not None:
            self.generator.iterate = timed(self.generator.iterate, self._add_iterate)

    def _add_step(self, seconds: float) -> None:
        self.clocks.step_s += seconds
        self.clocks.steps += 1

    def _add_iterate(self, seconds: float) -> None:
        self.clocks.iterate_s += seconds

    def close(self) -> None:
        self.sink.close()

    def run(self, side: str, prompts: list[list[int]]) -> Row:
        if side == "loop":
            return self.run_loop(prompts)
        if side == "bare":
            return self.run_bare(prompts)
        return self.run_generator(prompts)

    def run_loop(self, prompts: list[list[int]]) -> Row:
        requests = requests_for(prompts, self.max_new_tokens)
        loop = _TimedLoop(self.engine, self.clocks)
        loop.start(self.sink)
        try:
            self.clocks.reset()
            self.sink.expect(len(requests))
            time.sleep(IDLE_BEFORE_RUN_S)
            started = time.perf_counter()
            loop.add_many([(f"loop-{i}", r) for i, r in enumerate(requests)])
            if not self.sink.done.wait(RUN_TIMEOUT_S):
                raise RuntimeError(f"the loop's jobs did not end in {RUN_TIMEOUT_S:.0f} s")
            wall = self.sink.ended_at - started
        finally:
            loop.stop(RUN_TIMEOUT_S)  # its wait work leaves the engine with the loop
        c = self.clocks
        row: Row = {
            "tok_s": self.sink.tokens / wall,
            "wall_ms": wall * 1000,
            "steps": c.steps,
            # Beyond engine.step()'s own work: the loop's bookkeeping, its work in the
            # wait (held reports written there) and the reports it writes after a step.
            "loop_pct": 100 * (wall - (c.step_s - c.wait_s)) / wall,
            "wait_pct": 100 * c.wait_s / wall,
            "reports_pct": 100 * c.sink_s / wall,
        }
        if self.generator is not None:  # step() less its generator's iterate()
            row["chunks_pct"] = 100 * (c.step_s - c.iterate_s) / wall
        return row

    def run_bare(self, prompts: list[list[int]]) -> Row:
        for i, request in enumerate(requests_for(prompts, self.max_new_tokens)):
            self.engine.add(f"bare-{i}", request)
        time.sleep(IDLE_BEFORE_RUN_S)
        started = time.perf_counter()
        left, tokens = len(prompts), 0
        while left:
            jobs, made = endings(self.engine.step())
            left -= jobs
            tokens += made
            if time.perf_counter() - started > RUN_TIMEOUT_S:
                raise RuntimeError(f"the bare loop's jobs did not end in {RUN_TIMEOUT_S:.0f} s")
        wall = time.perf_counter() - started
        return {"tok_s": tokens / wall, "wall_ms": wall * 1000}

    def run_generator(self, prompts: list[list[int]]) -> Row:
        from bench.baselines import run_dynamic

        assert self.model is not None and self.generator is not None
        r = run_dynamic(
            self.generator,
            self.model,
            prompts,
            self.max_new_tokens,
            0,
            system="generator",
            idle_s=IDLE_BEFORE_RUN_S,
        )
        return {"tok_s": r["output_tokens_per_s"], "wall_ms": r["wall_s"] * 1000}


def measure(cost: LoopCost, args: argparse.Namespace) -> list[Row]:
    sides = ["loop", "bare"] + (["generator"] if cost.generator is not None else [])
    # Every kernel variant compiles here, untimed.
    for side in sides:
        cost.run(side, prompts_for(cost.model, min(8, max(args.concurrency)), 16, 999))
    runs: list[Row] = []
    for n in args.concurrency:
        for repeat in range(args.repeats):
            order = sides if repeat % 2 == 0 else sides[::-1]
            for k, side in enumerate(order):
                seed = 1_000 * (repeat + 1) + 10 * k + sides.index(side)
                prompts = prompts_for(cost.model, n, args.prompt_tokens, seed)
                row = {"side": side, "concurrency": n, "repeat": repeat}
                row.update(cost.run(side, prompts))
                runs.append(row)
                print(json.dumps({k: _rounded(v) for k, v in row.items()}), flush=True)
    return runs


def summarize(runs: list[Row]) -> list[Row]:
    """Per concurrency: each side's median tokens/s, the loop's median shares, and the
    loop's tokens/s over each other side's, the median of the repeats' ratios."""
    out = []
    for n in sorted({r["concurrency"] for r in runs}):
        at = [r for r in runs if r["concurrency"] == n]
        sides = sorted({r["side"] for r in at})
        row: Row = {"concurrency": n}
        for side in sides:
            row[f"{side}_tok_s"] = statistics.median(r["tok_s"] for r in at if r["side"] == side)
        loops = [r for r in at if r["side"] == "loop"]
        for key in ("loop_pct", "wait_pct", "reports_pct", "chunks_pct"):
            if loops and key in loops[0]:
                row[key] = statistics.median(r[key] for r in loops)
        for other in ("bare", "generator"):
            ratios = [
                loop["tok_s"] / peer["tok_s"]
                for loop in loops
                for peer in at
                if peer["side"] == other and peer["repeat"] == loop["repeat"]
            ]
            if ratios:
                row[f"loop_over_{other}"] = statistics.median(ratios)
        out.append(row)
    return out


def markdown(summary: list[Row]) -> str:
    lines = [
        "| N | loop tok/s | bare tok/s | generator tok/s | loop / bare | loop / generator | "
        "loop beyond step() % | of which its wait work % | of which writing reports % | "
        "step() beyond the generator % |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        cells = [
            _cell(s.get("loop_tok_s"), 0),
            _cell(s.get("bare_tok_s"), 0),
            _cell(s.get("generator_tok_s"), 0),
            _cell(s.get("loop_over_bare"), 3),
            _cell(s.get("loop_over_generator"), 3),
            _cell(s.get("loop_pct"), 2),
            _cell(s.get("wait_pct"), 2),
            _cell(s.get("reports_pct"), 2),
            _cell(s.get("chunks_pct"), 2),
        ]
        lines.append(f"| {s['concurrency']} | " + " | ".join(cells) + " |")
    lines += [
        "",
        "Shares of the loop's wall time, medians. Reports are written in the wait's work or "
        "after a step, so the two 'of which' columns overlap; step() beyond the generator is "
        "exllamav2's results made into TokenChunks.",
    ]
    return "\n".join(lines)


def _cell(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _rounded(value: Any) -> Any:
    return round(value, 3) if isinstance(value, float) else value


def load(args: argparse.Namespace) -> tuple[Engine, Path | None]:
    if args.engine == "echo":
        settings = WorkerSettings.load(
            {"tokens_per_second": args.echo_tokens_per_second},
            engine="echo",
            max_batch_size=max(args.concurrency),
        )
        return build_engine("echo", settings.load_request()), None
    from bench.make_checkpoint import model_for

    model, _ = model_for(args.shape, Path(args.models))
    settings = WorkerSettings.load(
        worker_options(engine_options(args)),
        engine=args.engine,
        model=model,
        max_batch_size=max(args.concurrency),
    )
    return build_engine(args.engine, settings.load_request()), model


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--engine", default="exllamav2", choices=["exllamav2", "echo"])
    ap.add_argument("--shape", default="1b", help="a preset shape or a model directory")
    ap.add_argument("--concurrency", default="8,64")
    ap.add_argument("--repeats", type=int, default=6)
    ap.add_argument("-p", "--prompt-tokens", type=int, default=256)
    ap.add_argument("-m", "--max-new-tokens", type=int, default=128)
    ap.add_argument("--stepper-cpu", type=int, default=3, help="-1: leave the CPUs alone")
    ap.add_argument("--echo-tokens-per-second", type=float, default=2_000.0)
    ap.add_argument("--models", default="/tmp/exlq-models")
    ap.add_argument("--out", type=Path, help="a JSON file for the runs and the summary")
    add_engine_options(ap)
    args = ap.parse_args(argv)
    args.concurrency = [int(n) for n in args.concurrency.split(",")]
    pinned = args.stepper_cpu >= 0 and args.stepper_cpu in os.sched_getaffinity(0)
    with on_cpus(frozenset({args.stepper_cpu}) if pinned else None):  # the loop's thread too
        engine, model = load(args)
        freeze_startup_heap()  # as the engine process does once its engine has loaded
        cost = LoopCost(engine, model, args.max_new_tokens)
        try:
            runs = measure(cost, args)
        finally:
            cost.close()
            engine.close()
    summary = summarize(runs)
    print(markdown(summary))
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "date": dt.date.today().isoformat(),
                    "args": vars(args) | {"out": None},
                    "runs": runs,
                    "summary": summary,
                },
                indent=1,
            )
        )


if __name__ == "__main__":
    main()

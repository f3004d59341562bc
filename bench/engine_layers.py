"""Which layer of the worker costs time per step. The same jobs run through, in turn:

  bare     ExLlamaV2DynamicGenerator.iterate() in a loop (what bench (a) times)
  barethread  the same loop on a thread of its own, started for the run
  engine   ExLlamaV2Engine.step() in a loop on the calling thread (our wrapper, no threads)
  thread   EngineLoop: the engine on a thread of its own, reports to a callback, set up as
           the engine process sets it up (EngineLoop.for_settings, collections held)
  nowait   EngineLoop with no work in the GPU's wait (no held reports, no adds in the
           wait, no collections held): what the wait work costs the step
  process  EngineProcess: the engine in a spawned process, reports over a pipe

Every layer but `process` shares one loaded generator, so their settings are identical,
and starts on an emptied page table, as the process's own generator meets each repeat's
new prompts (--keep-cache: a layer finds the prompts of the layers before it cached); the
process loads its own with the same settings. Every layer runs once per repeat, the order
turning by one each repeat, so the machine's drift falls on each alike. No Redis
anywhere: what is left between `process` and bench (b) is the worker's Redis and pub/sub
path.

With --cpu N, each layer's stepping thread runs on CPU N and every other thread of the
bench (and of the engine process, which runs on N whole) elsewhere, so that the layers do
not differ by the CPU the scheduler gives them.

Two times per layer, over the decode steps (a run's first eighth, which holds its
prefills, left out): `step`, the engine's own (iterate(), or what EngineLoop reports as a
step), and `period`, from one step's end to the next's: the step and everything the
layer does between two steps.

    python -m bench.engine_layers --model DIR --jobs 1,64 --out layers.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import pickle
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.baselines import random_prompt_ids
from bench.placement import on_cpus
from exlq.protocol.models import GenerationRequest
from exlq.worker.engine_loop import EngineLoop, StepReport
from exlq.worker.engine_process import encode_report
from exlq.worker.engines.base import JobEnded
from exlq.worker.gc_pauses import HeldCollections
from exlq.worker.settings import WorkerSettings


def _requests(model: Path, jobs: int, prompt_tokens: int, new_tokens: int, seed: int) -> list[Any]:
    return [
        GenerationRequest.model_validate(
            {
                "input_ids": ids,
                "max_new_tokens": new_tokens,
                "ignore_eos": True,
                "sampling": {"temperature": 0.0},
            }
        )
        for ids in random_prompt_ids(model, jobs, prompt_tokens, seed)
    ]


@dataclass
class Result:
    """One run of a layer: wall time, tokens made, and each step's length and end time."""

    elapsed: float
    tokens: int
    steps: list[float]
    ends: list[float]


def _decode(values: list[float]) -> list[float]:
    """The decode part of a run's per-step values: its first steps hold the prefills."""
    return values[max(1, len(values) // 8) :] or values


def _median_ms(values: list[float]) -> float | None:
    return statistics.median(values) * 1000 if values else None


def _figures(layer: str, jobs: int, result: Result) -> dict[str, Any]:
    periods = [b - a for a, b in itertools.pairwise(result.ends)]
    return {
        "layer": layer,
        "jobs": jobs,
        "tok_s": result.tokens / result.elapsed,
        "steps": len(result.steps),
        "step_ms_median": _median_ms(_decode(result.steps)),
        "period_ms_median": _median_ms(_decode(periods)),
        "elapsed_s": result.elapsed,
    }


def run_bare(engine: Any, requests: list[Any]) -> Result:
    import torch
    from exllamav2.generator import ExLlamaV2DynamicJob, ExLlamaV2Sampler

    generator = engine.generator
    jobs = [
        ExLlamaV2DynamicJob(
            input_ids=torch.tensor([r.input_ids], dtype=torch.long),
            max_new_tokens=r.max_new_tokens,
            stop_conditions=[],
            gen_settings=ExLlamaV2Sampler.Settings.greedy(),
            identifier=j,
        )
        for j, r in enumerate(requests)
    ]
    steps: list[float] = []
    ends: list[float] = []
    tokens = 0
    started = time.perf_counter()
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        t = time.perf_counter()
        results = generator.iterate()
        ends.append(time.perf_counter())
        steps.append(ends[-1] - t)
        tokens += sum(int(r["new_tokens"]) for r in results if r.get("eos"))
    return Result(time.perf_counter() - started, tokens, steps, ends)


def run_engine(engine: Any, requests: list[Any]) -> Result:
    """Also splits each step: time inside iterate(), and the wrapper's own (outputs built,
    cache usage read, the report encoded and pickled as EngineProcess sends it)."""
    steps: list[float] = []
    ends: list[float] = []
    tokens = 0
    inner: list[float] = []
    iterate = engine.generator.iterate

    def timed_iterate() -> Any:
        t = time.perf_counter()
        results = iterate()
        inner.append(time.perf_counter() - t)
        return results

    engine.generator.iterate = timed_iterate
    started = time.perf_counter()
    try:
        for j, request in enumerate(requests):
            engine.add(str(j), request)
        while engine.active_jobs:
            t = time.perf_counter()
            outputs = engine.step()
            report = StepReport(
                outputs, time.perf_counter() - t, engine.active_jobs, engine.cache_usage()
            )
            pickle.dumps(("report", encode_report(report)))
            ends.append(time.perf_counter())
            steps.append(ends[-1] - t)
            tokens += sum(o.completion_tokens for o in outputs if isinstance(o, JobEnded))
    finally:
        del engine.generator.iterate
    elapsed = time.perf_counter() - started
    WRAPPER_MS.append(statistics.median(s - i for s, i in zip(steps, inner, strict=True)) * 1000)
    return Result(elapsed, tokens, steps, ends)


WRAPPER_MS: list[float] = []


class RunnerDriver:
    """Drives an EngineRunner (EngineLoop or EngineProcess) the way the worker does: jobs in
    through add(), reports back on the runner's thread. One runner serves every batch."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._done = threading.Event()
        self._ended: list[JobEnded] = []
        self._steps: list[float] = []
        self._ends: list[float] = []
        self._expected = 0
        self._fatal: str | None = None
        runner.start(self._sink)

    def _sink(self, report: StepReport) -> None:
        if report.fatal:
            self._fatal = report.fatal
            self._done.set()
            return
        if report.step_seconds is not None:
            self._steps.append(report.step_seconds)
            self._ends.append(report.finished_at)
        self._ended += [o for o in report.outputs if isinstance(o, JobEnded)]
        if len(self._ended) >= self._expected:
            self._done.set()

    def run(self, requests: list[Any]) -> Result:
        self._done.clear()
        self._ended, self._steps, self._ends, self._expected = [], [], [], len(requests)
        started = time.perf_counter()
        self.runner.add_many([(f"{started}-{j}", request) for j, request in enumerate(requests)])
        if not self._done.wait(600) or self._fatal:
            raise RuntimeError(self._fatal or "jobs did not finish in 600 s")
        elapsed = time.perf_counter() - started
        tokens = sum(e.completion_tokens for e in self._ended)
        # A report's finished_at is the wall clock at the step's end, in either process.
        return Result(elapsed, tokens, list(self._steps), sorted(self._ends))


def _loop_run(loop: EngineLoop, requests: list[Any], cpus: frozenset[int] | None) -> Result:
    """One run through a loop of its own on the shared engine, stopped after it; its thread
    started on ``cpus``."""
    with on_cpus(cpus):
        driver = RunnerDriver(loop)
    try:
        return driver.run(requests)
    finally:
        loop.stop(60)


def _on_thread(run: Callable[[], Result], cpus: frozenset[int] | None) -> Result:
    """``run`` on a thread of its own, started on ``cpus``, for this call."""
    done: list[Result] = []
    with on_cpus(cpus):
        thread = threading.Thread(target=lambda: done.append(run()), name="bench-bare")
        thread.start()
    thread.join()
    if not done:
        raise RuntimeError("the run's thread failed")
    return done[0]


def _with_fresh_cache(
    engine: Any, run: Callable[[list[Any]], Result]
) -> Callable[[list[Any]], Result]:
    """``run``, on a page table emptied first. The in-process layers share one generator and
    run the same prompts in turn: without this, every layer after the first of a repeat
    found its prompts' pages cached, where the process layer's own generator did not."""

    def fresh(requests: list[Any]) -> Result:
        engine.generator.reset_page_table()
        return run(requests)

    return fresh


def _pinned(
    cpus: frozenset[int] | None, run: Callable[[list[Any]], Result]
) -> Callable[[list[Any]], Result]:
    """``run`` on the calling thread, moved to ``cpus`` for the call."""

    def call(requests: list[Any]) -> Result:
        with on_cpus(cpus):
            return run(requests)

    return call


LAYERS = ("bare", "barethread", "engine", "thread", "nowait", "process")


class Layers:
    """Runs the chosen layers at each job count; rows of figures out."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.settings = WorkerSettings(
            model=args.model,
            cache_tokens=args.cache_tokens,
            max_batch_size=args.max_batch_size,
            attention="exlq",
            sampling_threads=1,
        )
        self.counts = [int(n) for n in args.jobs.split(",")]
        self.layers = args.layers.split(",")
        unknown = set(self.layers) - set(LAYERS)
        if unknown:
            raise SystemExit(f"unknown layers {sorted(unknown)}: choose from {', '.join(LAYERS)}")
        self.rows: list[dict[str, Any]] = []
        self.child_pid = 0
        # --cpu: the stepping threads' CPU, and the one every other thread stays off.
        self.stepper_cpus: frozenset[int] | None = None
        if args.cpu is not None:
            self.stepper_cpus = frozenset({args.cpu})
            os.sched_setaffinity(0, os.sched_getaffinity(0) - self.stepper_cpus)

    def _batches(self, n: int, runs: dict[str, Callable[[list[Any]], Result]]) -> None:
        """A warm-up per layer (other prompts), then the layers in turn, repeat by repeat, so
        that drift of the machine between runs falls on every layer alike."""
        args = self.args
        for run in runs.values():
            run(_requests(args.model, n, args.prompt_tokens, 8, 1000))
        layers = list(runs)
        for repeat in range(args.repeats):
            requests = _requests(args.model, n, args.prompt_tokens, args.max_new_tokens, repeat)
            # Each repeat starts one layer later, so no layer always runs first or last.
            turn = repeat % len(layers)
            for layer in layers[turn:] + layers[:turn]:
                run = runs[layer]
                pid = self.child_pid if layer == "process" else os.getpid()
                spy = _py_spy(pid, args.py_spy, f"{layer}-{n}") if repeat == 0 else None
                row = _figures(layer, n, run(requests))
                if spy is not None:
                    spy.wait()
                if layer == "engine":
                    row["wrapper_ms_median"] = WRAPPER_MS[-1]
                row["repeat"] = repeat
                self.rows.append(row)
                print(json.dumps(row), flush=True)

    def _in_process_runs(self, engine: Any) -> dict[str, Callable[[list[Any]], Result]]:
        """The layers that share the loaded ``engine``, each on a page table emptied first
        (unless --keep-cache), its stepping thread on --cpu if given."""
        cpus = self.stepper_cpus
        runs: dict[str, Callable[[list[Any]], Result]] = {
            "bare": _pinned(cpus, lambda r: run_bare(engine, r)),
            "barethread": lambda r: _on_thread(lambda: run_bare(engine, r), cpus),
            "engine": _pinned(cpus, lambda r: run_engine(engine, r)),
            # One loop drives the engine at a time: each gives its wait work back when it
            # stops, so the loops are made and stopped per run.
            "thread": lambda r: _loop_run(
                EngineLoop.for_settings(engine, self.settings, HeldCollections()), r, cpus
            ),
            "nowait": lambda r: _loop_run(EngineLoop(engine, False, False, None), r, cpus),
        }
        if self.args.keep_cache:
            return runs
        return {layer: _with_fresh_cache(engine, run) for layer, run in runs.items()}

    def run(self) -> None:
        """Every chosen layer at each job count; the process, if chosen, is loaded first."""
        from exlq.worker.engine_process import EngineProcess
        from exlq.worker.engines.exllamav2.engine import load_exllamav2_engine

        process = EngineProcess(self.settings) if "process" in self.layers else None
        engine = None
        try:
            runs: dict[str, Callable[[list[Any]], Result]] = {}
            if process is not None:
                # Spawned on --cpu, the engine process runs there whole (it inherits the
                # CPUs); the relay thread RunnerDriver starts here stays off them.
                with on_cpus(self.stepper_cpus):
                    process.load()
                assert process.pid is not None
                self.child_pid = process.pid
                runs["process"] = RunnerDriver(process).run
            if set(self.layers) - {"process"}:
                engine = load_exllamav2_engine(self.settings)
                runs.update(self._in_process_runs(engine))
            chosen = {layer: runs[layer] for layer in self.layers}
            for n in self.counts:
                self._batches(n, chosen)
        finally:
            if process is not None:
                process.stop(60)
                process.close()
            if engine is not None:
                engine.close()

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        # Per job count, the bare runs by repeat: each run's period is set against its own.
        bare_runs: dict[int, dict[int, dict[str, Any]]] = {}
        for r in self.rows:
            if r["layer"] == "bare":
                bare_runs.setdefault(r["jobs"], {})[r["repeat"]] = r
        for layer, n in dict.fromkeys((r["layer"], r["jobs"]) for r in self.rows):
            mine = [r for r in self.rows if r["layer"] == layer and r["jobs"] == n]
            out[f"{layer}@{n}"] = {
                "tok_s_median": statistics.median(r["tok_s"] for r in mine),
                "step_ms_median": statistics.median(r["step_ms_median"] for r in mine),
                "period_ms_median": statistics.median(r["period_ms_median"] for r in mine),
                # The runs fall into two speeds of the machine's; the fastest run is the
                # layer's own cost at the better one.
                "period_ms_min": min(r["period_ms_median"] for r in mine),
            }
            bare = bare_runs.get(n, {})
            ratios = [
                r["period_ms_median"] / bare[r["repeat"]]["period_ms_median"]
                for r in mine
                if r["repeat"] in bare
            ]
            if ratios and layer != "bare":
                out[f"{layer}@{n}"]["period_vs_bare_median"] = statistics.median(ratios)
            if "wrapper_ms_median" in mine[0]:
                wrapper = statistics.median(r["wrapper_ms_median"] for r in mine)
                out[f"{layer}@{n}"]["wrapper_ms_median"] = wrapper
        return out


def _py_spy(pid: int, out_dir: Path | None, name: str) -> subprocess.Popen[bytes] | None:
    """Sample the process running the layer for 3 s (py-spy, collapsed stacks), if asked."""
    if out_dir is None:
        return None
    return subprocess.Popen(
        ["py-spy", "record", "--pid", str(pid), "--duration", "3", "--rate", "400",
         "--nonblocking", "--format", "raw", "-o", str(out_dir / f"{name}.txt")],
    )  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", required=True, type=Path)
    ap.add_argument("--jobs", default="1,64")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--cache-tokens", type=int, default=65536)
    ap.add_argument("--max-batch-size", type=int, default=128)
    ap.add_argument("--layers", default=",".join(LAYERS))
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument(
        "--keep-cache",
        action="store_true",
        help="the in-process layers keep the page table of the runs before (prompts cached)",
    )
    ap.add_argument("--cpu", type=int, default=None, help="the stepping threads' one CPU")
    ap.add_argument("--py-spy", type=Path, default=None, help="folder for py-spy samples")
    ap.add_argument("--out", type=Path, default=None)
    layers = Layers(ap.parse_args())
    layers.run()
    summary = layers.summary()
    for key, value in summary.items():
        wrapper = value.get("wrapper_ms_median")
        against = value.get("period_vs_bare_median")
        print(
            f"{key:>12}: {value['tok_s_median']:8.1f} tok/s  step {value['step_ms_median']:6.3f}"
            f" ms  period {value['period_ms_median']:6.3f} ms"
            f" (fastest {value['period_ms_min']:.3f})"
            + (f"  period/bare {against:.3f}" if against is not None else "")
            + (f"  (wrapper {wrapper:.3f} ms)" if wrapper is not None else "")
        )
    if layers.args.out:
        layers.args.out.write_text(json.dumps({"rows": layers.rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()

"""Which layer of the worker costs time per step. The same jobs run through, in turn:

  bare     ExLlamaV2DynamicGenerator.iterate() in a loop (what bench (a) times)
  engine   ExLlamaV2Engine.step() in a loop on the calling thread (our wrapper, no threads)
  thread   EngineLoop: the engine on a thread of its own, reports to a callback, set up as
           the engine process sets it up (EngineLoop.for_settings, collections held)
  process  EngineProcess: the engine in a spawned process, reports over a pipe

The first three share one loaded generator, so their settings are identical; the process
loads its own with the same settings. No Redis anywhere: what is left between `process` and
bench (b) is the worker's Redis and pub/sub path.

    python -m bench.engine_layers --model DIR --jobs 1,64 --out layers.json
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.baselines import random_prompt_ids
from producer.protocol import GenerationRequest
from worker.engine_loop import EngineLoop, StepReport
from worker.engine_process import encode_report
from worker.engines.base import JobEnded
from worker.gc_pauses import HeldCollections
from worker.settings import WorkerSettings


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


Result = tuple[float, int, list[float]]


def _figures(
    layer: str, jobs: int, elapsed: float, tokens: int, steps: list[float]
) -> dict[str, Any]:
    # Decode steps only: the first steps of a run hold the prefills.
    decode = steps[max(1, len(steps) // 8) :] or steps
    return {
        "layer": layer,
        "jobs": jobs,
        "tok_s": tokens / elapsed,
        "steps": len(steps),
        "step_ms_median": statistics.median(decode) * 1000 if decode else None,
        "elapsed_s": elapsed,
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
    tokens = 0
    started = time.perf_counter()
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        t = time.perf_counter()
        results = generator.iterate()
        steps.append(time.perf_counter() - t)
        tokens += sum(int(r["new_tokens"]) for r in results if r.get("eos"))
    return time.perf_counter() - started, tokens, steps


def run_engine(engine: Any, requests: list[Any]) -> Result:
    """Also splits each step: time inside iterate(), and the wrapper's own (outputs built,
    cache usage read, the report encoded and pickled as EngineProcess sends it)."""
    steps: list[float] = []
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
            steps.append(time.perf_counter() - t)
            tokens += sum(o.completion_tokens for o in outputs if isinstance(o, JobEnded))
    finally:
        del engine.generator.iterate
    elapsed = time.perf_counter() - started
    WRAPPER_MS.append(statistics.median(s - i for s, i in zip(steps, inner, strict=True)) * 1000)
    return elapsed, tokens, steps


WRAPPER_MS: list[float] = []


class RunnerDriver:
    """Drives an EngineRunner (EngineLoop or EngineProcess) the way the worker does: jobs in
    through add(), reports back on the runner's thread. One runner serves every batch."""

    def __init__(self, runner: Any) -> None:
        self.runner = runner
        self._done = threading.Event()
        self._ended: list[JobEnded] = []
        self._steps: list[float] = []
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
        self._ended += [o for o in report.outputs if isinstance(o, JobEnded)]
        if len(self._ended) >= self._expected:
            self._done.set()

    def run(self, requests: list[Any]) -> Result:
        self._done.clear()
        self._ended, self._steps, self._expected = [], [], len(requests)
        started = time.perf_counter()
        self.runner.add_many([(f"{started}-{j}", request) for j, request in enumerate(requests)])
        if not self._done.wait(600) or self._fatal:
            raise RuntimeError(self._fatal or "jobs did not finish in 600 s")
        elapsed = time.perf_counter() - started
        return elapsed, sum(e.completion_tokens for e in self._ended), list(self._steps)


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
        self.rows: list[dict[str, Any]] = []

    def _batches(self, n: int, runs: dict[str, Callable[[list[Any]], Result]], pid: int) -> None:
        """A warm-up per layer (other prompts), then the layers in turn, repeat by repeat, so
        that drift of the machine between runs falls on every layer alike."""
        args = self.args
        for run in runs.values():
            run(_requests(args.model, n, args.prompt_tokens, 8, 1000))
        for repeat in range(args.repeats):
            requests = _requests(args.model, n, args.prompt_tokens, args.max_new_tokens, repeat)
            for layer, run in runs.items():
                spy = _py_spy(pid, args.py_spy, f"{layer}-{n}") if repeat == 0 else None
                row = _figures(layer, n, *run(requests))
                if spy is not None:
                    spy.wait()
                if layer == "engine":
                    row["wrapper_ms_median"] = WRAPPER_MS[-1]
                self.rows.append(row)
                print(json.dumps(row), flush=True)

    def in_process(self) -> None:
        from worker.engines.exllamav2_engine import load_exllamav2_engine

        engine = load_exllamav2_engine(self.settings)
        # As the engine process runs it: the worker's settings, collections held per burst.
        thread = RunnerDriver(EngineLoop.for_settings(engine, self.settings, HeldCollections()))
        runs: dict[str, Callable[[list[Any]], Result]] = {
            "bare": lambda r: run_bare(engine, r),
            "engine": lambda r: run_engine(engine, r),
            "thread": thread.run,
        }
        chosen = {layer: run for layer, run in runs.items() if layer in self.layers}
        for n in self.counts:
            self._batches(n, chosen, os.getpid())
        thread.runner.stop(60)
        engine.close()

    def in_child(self) -> None:
        from worker.engine_process import EngineProcess

        process = EngineProcess(self.settings)
        process.load()
        driver = RunnerDriver(process)
        try:
            for n in self.counts:
                assert process.pid is not None
                self._batches(n, {"process": driver.run}, process.pid)
        finally:
            process.stop(60)
            process.close()

    def summary(self) -> dict[str, dict[str, float]]:
        out = {}
        for layer, n in dict.fromkeys((r["layer"], r["jobs"]) for r in self.rows):
            mine = [r for r in self.rows if r["layer"] == layer and r["jobs"] == n]
            out[f"{layer}@{n}"] = {
                "tok_s_median": statistics.median(r["tok_s"] for r in mine),
                "step_ms_median": statistics.median(r["step_ms_median"] for r in mine),
            }
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
    ap.add_argument("--layers", default="bare,engine,thread,process")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--py-spy", type=Path, default=None, help="folder for py-spy samples")
    ap.add_argument("--out", type=Path, default=None)
    layers = Layers(ap.parse_args())
    if set(layers.layers) - {"process"}:
        layers.in_process()
    if "process" in layers.layers:
        layers.in_child()
    summary = layers.summary()
    for key, value in summary.items():
        wrapper = value.get("wrapper_ms_median")
        print(
            f"{key:>12}: {value['tok_s_median']:8.1f} tok/s {value['step_ms_median']:6.2f} ms"
            + (f" (wrapper {wrapper:.3f} ms)" if wrapper is not None else "")
        )
    if layers.args.out:
        layers.args.out.write_text(json.dumps({"rows": layers.rows, "summary": summary}, indent=2))


if __name__ == "__main__":
    main()

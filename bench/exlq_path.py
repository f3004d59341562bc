"""(b) The full exlq path: producer SDK -> Redis -> `exlq worker` -> pub/sub -> SDK."""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, TypedDict

from bench import thread_clock
from bench.baselines import IDLE_BEFORE_RUN_S, _summarize, percentiles, random_prompt_ids
from bench.placement import on_cpus
from exlq.producer import AsyncProducer, DoneEvent, TokenEvent
from exlq.worker.embedded_redis import RedisServer, free_port
from exlq.worker.engines.exllamav2.settings import ExLlamaV2Settings
from exlq.worker.engines.registry import find

# The exllamav2 engine's defaults, which every bench gives both its systems unless told
# otherwise.
_DEFAULTS = ExLlamaV2Settings.model_fields
CACHE_TOKENS: int = _DEFAULTS["cache_tokens"].default
PREFILL_BATCH_TOKENS: int = _DEFAULTS["prefill_batch_tokens"].default
ADMIT_PROMPT_TOKENS: int = _DEFAULTS["admit_prompt_tokens"].default
GPU_EMBEDDING: bool = _DEFAULTS["gpu_embedding"].default


def add_engine_options(ap: argparse.ArgumentParser) -> None:
    """The engine options a bench gives exlq's engine alike, alone and in the worker."""
    ap.add_argument("--cache-tokens", type=int, default=CACHE_TOKENS)
    ap.add_argument(
        "--prefill-batch-tokens",
        type=int,
        default=PREFILL_BATCH_TOKENS,
        help="batched prefill budget; 0 prefills one job a pass",
    )
    ap.add_argument(
        "--admit-prompt-tokens",
        type=int,
        default=ADMIT_PROMPT_TOKENS,
        help="prompt tokens the jobs one step starts may hold (0: all that fit)",
    )
    ap.add_argument(
        "--gpu-embedding",
        action=argparse.BooleanOptionalAction,
        default=GPU_EMBEDDING,
        help="the embedding table on the GPU (off: in system memory, as exllamav2 loads it)",
    )


def add_client_options(ap: argparse.ArgumentParser) -> None:
    """The bench process's own switches: its collector, and how its SDK sends ids."""
    ap.add_argument(
        "--freeze-gc",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="move what the bench process has loaded out of the collector's reach before the "
        "runs (freeze_loaded_objects); without it, a full collection of the loaded model's "
        "objects (about 230 ms on the H100 host) lands in some runs of the SDK's clients",
    )
    ap.add_argument(
        "--pack-ids",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the SDK sends each prompt's ids as input_ids_b64, one base64 string "
        "(AsyncProducer(pack_ids=True)); by default, as the SDK does, an input_ids list",
    )


def freeze_loaded_objects() -> None:
    """gc.collect(), then gc.freeze(): the objects loaded so far (a model, its tokenizer,
    exllamav2 and torch) leave the collector's generations, so a full collection during a
    run scans only what the runs made. The bench process holds a model and the SDK's
    clients together, which no client process of a service does."""
    gc.collect()
    gc.freeze()


class EngineOptions(TypedDict):
    """add_engine_options' values: the keywords EngineAlone and the generator benches take,
    and the worker's exllamav2 options (-o NAME=VALUE) with ``worker_options``."""

    cache_tokens: int
    prefill_batch_tokens: int
    admit_prompt_tokens: int
    gpu_embedding: bool


def engine_options(args: argparse.Namespace) -> EngineOptions:
    return {
        "cache_tokens": args.cache_tokens,
        "prefill_batch_tokens": args.prefill_batch_tokens,
        "admit_prompt_tokens": args.admit_prompt_tokens,
        "gpu_embedding": args.gpu_embedding,
    }


def worker_options(options: EngineOptions) -> dict[str, object]:
    """The exllamav2 options of a worker that runs as the engine alone does: the same
    options, and exlq's attention kernel, which the engine alone installs."""
    return {**options, "attention": "exlq"}


ROOT = Path(__file__).resolve().parent.parent
QUEUE = "bench"


class WorkerProcess:
    """`exlq worker` in a process of its own, as users run it."""

    def __init__(
        self, args: Sequence[str], env: Mapping[str, str], cpus: frozenset[int] | None
    ) -> None:
        """``args`` follow `exlq worker`; ``env`` is added to this process's environment."""
        self.metrics_port = free_port()
        log_path = os.environ.get("EXLQ_BENCH_WORKER_LOG", "/tmp/exlq-bench-worker.log")
        self.log = open(log_path, "a")  # noqa: SIM115 - lives with the process
        command = [sys.executable, "-m", "exlq", "worker", *args]
        command += ["--metrics-port", str(self.metrics_port), "--log-level", "WARNING"]
        with on_cpus(cpus):  # the worker inherits this thread's CPUs
            self.process = subprocess.Popen(
                command, cwd=ROOT, env=os.environ | env, stdout=self.log, stderr=subprocess.STDOUT
            )

    def _url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.metrics_port}{path}"

    def wait_ready(self, timeout_s: float = 600.0) -> float:
        started = time.monotonic()
        while time.monotonic() - started < timeout_s:
            if self.process.poll() is not None:
                raise RuntimeError(
                    f"worker exited with {self.process.returncode}; see {self.log.name}"
                )
            try:
                with urllib.request.urlopen(self._url("/readyz"), timeout=1):
                    return time.monotonic() - started
            except OSError:
                time.sleep(0.5)
        raise TimeoutError("worker not ready")

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(self._url("/metrics"), timeout=5) as r:
            for line in r.read().decode().splitlines():
                if line.startswith(name + "{") or line.startswith(name + " "):
                    return float(line.rsplit(" ", 1)[1])
        return 0.0

    def stop(self) -> None:
        self.process.terminate()
        try:
            self.process.wait(60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()


async def _run_point(
    redis_url: str,
    warm_up: list[list[int]],
    prompts: list[list[int]],
    max_new_tokens: int,
    after_warm_up: Callable[[], object],
    pack_ids: bool,
) -> tuple[float, float, list[list[float]], int, dict[str, list[float]], list[int | None]]:
    """Times are per token event as the SDK receives it: a chunk of several tokens (text held
    back by the generator, e.g. partial UTF-8) is one arrival. The parts of the TTFT come
    back too: submit() returning, and the worker's own timings from the done event; and how
    many tokens each job's first event carried.

    First as many short jobs as the run has, on other prompts, through the same producer:
    kernel variants compile there, the prefix cache learns nothing of the real prompts, and
    the producer's connections are open before the clock starts, as in a service that keeps
    its producer."""
    async with AsyncProducer(redis_url, queue=QUEUE, pack_ids=pack_ids) as producer:
        # Submitted at once, as the run does, so the producer's pool holds as many open
        # connections as the run will use.
        handles = await asyncio.gather(
            *(producer.submit(input_ids=ids, max_new_tokens=8, ignore_eos=True) for ids in warm_up)
        )
        await asyncio.gather(*(h.result(timeout=600) for h in handles))
        after_warm_up()
        times: list[list[float]] = [[] for _ in prompts]
        counts = [0] * len(prompts)
        first_counts: list[int | None] = [None] * len(prompts)
        parts: dict[str, list[float]] = {"submit": [], "queued": [], "first_token": []}

        async def one(j: int, ids: list[int]) -> None:
            handle = await producer.submit(
                input_ids=ids,
                max_new_tokens=max_new_tokens,
                ignore_eos=True,
                sampling={"temperature": 0.0},
            )
            parts["submit"].append(time.perf_counter() - t0)
            async for event in handle.stream():
                if isinstance(event, TokenEvent):
                    times[j].append(time.perf_counter())
                    if first_counts[j] is None:
                        first_counts[j] = len(event.token_ids)
                    counts[j] += len(event.token_ids)
                elif isinstance(event, DoneEvent):
                    parts["queued"].append(event.timings.queued_s)
                    if event.timings.first_token_s is not None:
                        parts["first_token"].append(event.timings.first_token_s)
                    return
                else:
                    raise RuntimeError(f"job {j}: {event}")

        await asyncio.sleep(IDLE_BEFORE_RUN_S)  # as every system: the worker idles meanwhile
        t0 = time.perf_counter()
        await asyncio.gather(*(one(j, ids) for j, ids in enumerate(prompts)))
        t_end = time.perf_counter()
    return t0, t_end, times, sum(counts), parts, first_counts


class ExlqPath:
    """Redis and one `exlq worker` on the model, kept up across runs: ``run()`` times one
    burst of jobs through the producer SDK, as system (b). ``engine="echo"`` runs the same
    harness without a GPU (the tests do)."""

    def __init__(
        self,
        model_dir: str | Path,
        *,
        max_batch_size: int,
        options: Mapping[str, object] | None = None,
        engine: str = "exllamav2",
        engine_runner: str = "process",
        worker_cpus: frozenset[int] | None = None,
        redis_cpus: frozenset[int] | None = None,
        trace_file: Path | None = None,
        pack_ids: bool = False,
    ) -> None:
        """``options`` are the engine's (`exlq worker -o NAME=VALUE`); ``engine_runner`` is
        EXLQ_ENGINE_RUNNER. ``trace_file``: the worker's processes trace their stages into
        it (EXLQ_TRACE_FILE, exlq.worker.tracing; bench.path_trace). ``pack_ids``: the SDK
        sends prompts as input_ids_b64 (AsyncProducer(pack_ids=...))."""
        self.model_dir = Path(model_dir)
        self.max_batch_size = max_batch_size
        self.options = dict(options or {})
        self.args = ["--engine", engine, "--queue", QUEUE, "--max-batch-size", str(max_batch_size)]
        # Absolute: the worker runs in the repository's root, not in this process's folder.
        if find(engine).needs_model:
            self.args += ["--model", str(self.model_dir.resolve())]
        for name, value in self.options.items():
            shown = str(value).lower() if isinstance(value, bool) else str(value)
            self.args += ["-o", f"{name}={shown}"]
        self.env = {"EXLQ_ENGINE_RUNNER": engine_runner}
        if trace_file is not None:
            self.env["EXLQ_TRACE_FILE"] = str(trace_file.resolve())
        self.system = "exlq" if engine_runner == "process" else f"exlq-{engine_runner}"
        self.worker_cpus = worker_cpus
        self.redis_cpus = redis_cpus
        self.pack_ids = pack_ids
        self.load_s = 0.0
        self._redis = RedisServer()
        self._worker: WorkerProcess | None = None
        # The threads of the last run's processes and what each spent (pin_stepper).
        self._last_run: tuple[list[int], int, dict[tuple[int, int], thread_clock.ThreadTimes]]
        self._last_run = ([], 0, {})

    def __enter__(self) -> ExlqPath:
        with on_cpus(self.redis_cpus):  # Redis inherits this thread's CPUs
            self._redis.__enter__()
        try:
            args = [*self.args, "--redis-url", self._redis.url]
            self._worker = WorkerProcess(args, self.env, self.worker_cpus)
            self.load_s = self._worker.wait_ready()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    @property
    def redis_pid(self) -> int | None:
        return self._redis.pid

    @property
    def worker_pid(self) -> int | None:
        return self._worker.process.pid if self._worker is not None else None

    def pin_stepper(self, cpu: int) -> None:
        """The engine's stepping thread (the busiest thread of the engine's process in the
        last run) alone on ``cpu``, and the worker's other threads on the rest of its CPUs;
        a run must have gone first."""
        pids, engine_pid, spent = self._last_run
        stepper = thread_clock.busiest_thread(spent, engine_pid)
        if stepper is None:
            raise RuntimeError("pin_stepper: no run yet shows the engine's stepping thread")
        others = (self.worker_cpus or frozenset(os.sched_getaffinity(0))) - {cpu}
        if not others:
            raise ValueError(f"pin_stepper: the worker needs CPUs besides {cpu}")
        thread_clock.pin(pids, others, stepper, cpu)

    def __exit__(self, *exc: object) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        self._redis.__exit__(None, None, None)

    def run(
        self, prompts: list[list[int]], warm_up: list[list[int]], max_new_tokens: int
    ) -> dict[str, Any]:
        worker = self._worker
        assert worker is not None, "use ExlqPath as a context manager"
        before: dict[str, float] = {}
        # The engine's stepping thread runs in the engine process, or in the worker itself.
        engine_pid = thread_clock.spawned_child(worker.process.pid) or worker.process.pid
        pids = list({worker.process.pid, engine_pid})
        threads_before: thread_clock.Snapshot = {}

        def read_step_metrics(into: dict[str, float] = before) -> None:
            for name in ("count", "sum"):
                into[name] = worker.metric(f"exlq_engine_step_seconds_{name}")
            threads_before.update(thread_clock.snapshot(pids))

        t0, t_end, times, completion, parts, first_counts = asyncio.run(
            _run_point(
                self._redis.url, warm_up, prompts, max_new_tokens, read_step_metrics, self.pack_ids
            )
        )
        spent = thread_clock.diff(threads_before, thread_clock.snapshot(pids))
        self._last_run = (pids, engine_pid, spent)
        steps = worker.metric("exlq_engine_step_seconds_count") - before["count"]
        step_sum = worker.metric("exlq_engine_step_seconds_sum") - before["sum"]
        out = _summarize(
            system=self.system,
            model_dir=self.model_dir,
            concurrency=len(prompts),
            prompt_tokens=len(prompts[0]),
            max_new_tokens=max_new_tokens,
            t0=t0,
            t_end=t_end,
            token_times=times,
            completion_tokens=completion,
            first_event_tokens=first_counts,
        )
        out.update(
            {
                "sdk_pack_ids": self.pack_ids,
                "steps": int(steps),
                "step_ms_mean": step_sum / steps * 1000 if steps else None,
                "max_batch_size": self.max_batch_size,
                "cache_tokens": self.options.get("cache_tokens"),
                "attention": self.options.get("attention"),
                "load_s": self.load_s,
                # Where the TTFT goes: the client's submit() (subscribe + enqueue), the
                # worker's enqueue -> start and enqueue -> first token.
                **{
                    f"{name}_ms_p50": percentiles([v * 1000 for v in values], [50])[0]
                    for name, values in parts.items()
                },
                "note": "times are when the SDK received each token event (ITL per event)",
                **thread_clock.stepper_figures(spent, int(steps), engine_pid),
            }
        )
        return out


def bench_exlq(
    model_dir: str | Path,
    concurrencies: list[int],
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    options: Mapping[str, object],
    engine_runner: str = "process",
    worker_cpus: frozenset[int] | None = None,
    seed: int = 0,
) -> list[dict[str, Any]]:
    """One worker (max_batch_size = the largest concurrency) serves every point."""
    results = []
    with ExlqPath(
        model_dir,
        max_batch_size=max(concurrencies),
        options=options,
        engine_runner=engine_runner,
        worker_cpus=worker_cpus,
    ) as path:
        for n in concurrencies:
            out = path.run(
                random_prompt_ids(model_dir, n, prompt_tokens, seed),
                random_prompt_ids(model_dir, n, prompt_tokens, seed + 1000),
                max_new_tokens,
            )
            results.append(out)
            print(f"exlq n={n}: {out['output_tokens_per_s']:.0f} tok/s", flush=True)
    return results

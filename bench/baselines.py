"""Baseline benchmarks: bare exllamav2 dynamic generator, its websocket server, transformers."""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib
import itertools
import json
import math
import os
import queue
import random
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "bench_exllamav2_dynamic",
    "bench_exllamav2_websocket",
    "bench_transformers",
    "memory_bandwidth_floor_ms",
    "percentiles",
    "random_prompt_ids",
    "texts_with_token_count",
    "weight_bytes",
]

FIRST_ORDINARY_ID = 3  # ids 0, 1, 2 are <unk>, <s>, </s> in bench/make_checkpoint.py checkpoints
WS_READY = "EXLQ_WS_READY"
WS_STATS = "EXLQ_WS_STATS"
# Every system idles this long before its timed burst, as a server meets a burst after a
# quiet spell. exlq's engine is idle while the burst travels to it; an engine that started
# right after its warm-up jobs met it busy, and on the H100 that was worth 1.1-2.1 ms of
# TTFT at one job (20 and 200 ms idle alike; a spinning CPU, 0.4 at most). The runs are at
# edd6206: git show edd6206:bench/results/2026-11-23-H100-paired/idle-start-1b.json
IDLE_BEFORE_RUN_S = 0.1


# --------------------------------------------------------------------------- helpers


def percentiles(values: Sequence[float], ps: Sequence[float] = (50, 99)) -> list[float | None]:
    """Percentiles, linearly interpolated (numpy's default); None for each p if values is empty."""
    if not values:
        return [None for _ in ps]
    xs = sorted(values)
    out: list[float | None] = []
    for p in ps:
        if not 0 <= p <= 100:
            raise ValueError(f"percentile out of range: {p}")
        k = (len(xs) - 1) * p / 100.0
        lo = math.floor(k)
        hi = min(lo + 1, len(xs) - 1)
        out.append(xs[lo] + (xs[hi] - xs[lo]) * (k - lo))
    return out


def weight_bytes(model_dir: str | Path) -> int:
    """Bytes of every tensor in the directory's *.safetensors files (only the headers are read)."""
    total = 0
    files = sorted(Path(model_dir).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {model_dir}")
    for f in files:
        with f.open("rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            start, end = info["data_offsets"]
            total += int(end) - int(start)
    return total


def memory_bandwidth_floor_ms(model_dir: str | Path, gpu_bandwidth_bytes_per_s: float) -> float:
    """Floor of one decode step in ms: every weight byte read once at full memory bandwidth."""
    return weight_bytes(model_dir) / gpu_bandwidth_bytes_per_s * 1000.0


def _vocab_size(model_dir: str | Path) -> int:
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    return int(cfg["vocab_size"])


def random_prompt_ids(
    model_dir: str | Path, n: int, prompt_tokens: int, seed: int = 0
) -> list[list[int]]:
    """n prompts of prompt_tokens random ordinary token ids, each different (no prefix reuse),
    also from the prompts of every other n: a server that keeps its prefix cache from one
    concurrency point to the next (exlq's worker does) must not find the next point's
    prompts cached, where a generator loaded afresh for each point would not."""
    vocab = _vocab_size(model_dir)
    out = []
    for i in range(n):
        rng = random.Random(f"{seed}/{n}/{i}")
        out.append([rng.randrange(FIRST_ORDINARY_ID, vocab) for _ in range(prompt_tokens)])
    return out


def texts_with_token_count(
    model_dir: str | Path, n: int, prompt_tokens: int, seed: int = 0
) -> list[str]:
    """n random texts, each exactly prompt_tokens tokens (no BOS) with the dir's tokenizer.json.

    Built from whole-word tokens (" word" pieces that encode to one token), so the count is exact.
    """
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(Path(model_dir) / "tokenizer.json"))
    cands = sorted(
        " " + piece[1:]
        for piece, i in tok.get_vocab().items()
        if i >= FIRST_ORDINARY_ID
        and piece.startswith("Ġ")
        and len(piece) >= 3
        and piece[1:].isascii()
        and piece[1:].isalpha()
    )
    encs = tok.encode_batch(cands, add_special_tokens=False)
    words = [w for w, e in zip(cands, encs, strict=True) if len(e.ids) == 1]
    if not words:
        raise RuntimeError("tokenizer has no single-token words to build prompts from")

    def count(parts: list[str]) -> int:
        return len(tok.encode("".join(parts), add_special_tokens=False).ids)

    texts = []
    for i in range(n):
        rng = random.Random(seed * 1_000_003 + i)
        parts = rng.choices(words, k=prompt_tokens)
        for _ in range(100):
            c = count(parts)
            if c == prompt_tokens:
                break
            if c > prompt_tokens:
                parts.pop()
            else:
                parts.append(rng.choice(words))
        else:
            raise RuntimeError(f"could not build a text of exactly {prompt_tokens} tokens")
        texts.append("".join(parts))
    return texts


def _ms(values: Sequence[float]) -> list[float]:
    return [v * 1000.0 for v in values]


def _summarize(
    *,
    system: str,
    model_dir: str | Path,
    concurrency: int,
    prompt_tokens: int,
    max_new_tokens: int,
    t0: float,
    t_end: float,
    token_times: Sequence[Sequence[float]],
    completion_tokens: int,
    per_token_times: bool = True,
    first_event_tokens: Sequence[int | None] | None = None,
) -> dict[str, Any]:
    """Common figures. token_times[j] = arrival times (perf_counter) of job j's tokens or chunks.

    ``ttft_ms_jobs`` keeps each job's first arrival, in the jobs' order (None for a job that
    got nothing): two systems' runs on the same prompts compare job by job (bench.paired).
    ``first_event_tokens[j]``, where a system counts them, is how many tokens job j's first
    arrival carried: more than one where the generator held text back (partial UTF-8)."""
    first_ms = [(tt[0] - t0) * 1000.0 if tt else None for tt in token_times]
    itl = (
        [b - a for tt in token_times for a, b in itertools.pairwise(tt)] if per_token_times else []
    )
    wall = t_end - t0
    first_events = (
        {} if first_event_tokens is None else {"first_event_tokens": list(first_event_tokens)}
    )
    t50, t99 = percentiles([t for t in first_ms if t is not None])
    i50, i99 = percentiles(_ms(itl))
    return {
        "system": system,
        "model_dir": str(model_dir),
        "concurrency": concurrency,
        "jobs": len(token_times),
        "prompt_tokens": prompt_tokens,
        "max_new_tokens": max_new_tokens,
        "completion_tokens": completion_tokens,
        "wall_s": wall,
        # perf_counter at the burst's start: CLOCK_MONOTONIC, one clock across processes
        # (the GPU clock samples of bench.gpu_clocks line up with it)
        "started_at": t0,
        "output_tokens_per_s": completion_tokens / wall if wall > 0 else None,
        "ttft_ms_p50": t50,
        "ttft_ms_p99": t99,
        "ttft_ms_jobs": [None if t is None else round(t, 3) for t in first_ms],
        "itl_ms_p50": i50,
        "itl_ms_p99": i99,
        **first_events,
    }


def _cuda_reset_peak() -> bool:
    import torch

    if not torch.cuda.is_available():
        return False
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    return True


def _cuda_peak() -> int | None:
    import torch

    if not torch.cuda.is_available():
        return None
    torch.cuda.synchronize()
    return int(torch.cuda.max_memory_allocated())


def _free_gpu() -> None:
    gc.collect()
    try:
        import torch
    except ImportError:
        return
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.empty_cache()


def _gib(n: int | None) -> float | None:
    return None if n is None else n / 1024**3


# --------------------------------------------------------------------------- (a) bare exllamav2

PAGE_SIZE = 256  # exllamav2.attn.PAGED_PAGE_SIZE


class _StepLog:
    """Per-job token times (made, and handed to the caller) and per-iterate() timings of one
    dynamic-generator run."""

    def __init__(self, jobs: int) -> None:
        self.token_times: list[list[float]] = [[] for _ in range(jobs)]
        self.event_times: list[list[float]] = [[] for _ in range(jobs)]
        self.first_event_tokens: list[int | None] = [None] * jobs
        self.seen = [0] * jobs
        self.final_tokens: list[int | None] = [None] * jobs
        self.step_ms: list[float] = []
        self.decode_step_ms: list[float] = []
        self.decode_step_batch: list[float] = []
        self.t_end = 0.0

    def record(self, results: list[dict[str, Any]], ts: float, te: float) -> None:
        """Log one iterate(): results are its dicts, ts/te the times before and after the call."""
        self.step_ms.append((te - ts) * 1000.0)
        prefill = False
        produced = 0
        touched: set[int] = set()
        for r in results:
            if r["stage"] in ("started", "prefill"):
                prefill = True
            if r["stage"] != "streaming":
                continue
            j = int(r["identifier"])
            if "token_ids" in r:  # tokens handed to the caller (held-back text comes later)
                if not self.event_times[j]:
                    self.first_event_tokens[j] = int(r["token_ids"].shape[-1])
                self.event_times[j].append(te)
            if j not in touched:
                touched.add(j)
                # job.new_tokens counts tokens even while their text is held back (partial UTF-8)
                n = int(r["job"].new_tokens)
                if n > self.seen[j]:
                    self.token_times[j].extend([te] * (n - self.seen[j]))
                    produced += n - self.seen[j]
                    self.seen[j] = n
            if r["eos"]:
                self.final_tokens[j] = int(r["new_tokens"])
                self.t_end = te
        if produced and not prefill:
            self.decode_step_ms.append((te - ts) * 1000.0)
            self.decode_step_batch.append(float(produced))

    def figures(self) -> dict[str, Any]:
        return {
            "steps": len(self.step_ms),
            "step_ms_median": percentiles(self.step_ms, [50])[0],
            "step_ms_mean": sum(self.step_ms) / len(self.step_ms) if self.step_ms else None,
            "decode_steps": len(self.decode_step_ms),
            "decode_step_ms_median": percentiles(self.decode_step_ms, [50])[0],
            "decode_step_ms_p99": percentiles(self.decode_step_ms, [99])[0],
            "decode_step_batch_median": percentiles(self.decode_step_batch, [50])[0],
        }


def exl_load(
    model_dir: str | Path,
    concurrency: int,
    cache_tokens: int,
    paged: bool,
    max_chunk_size: int | None,
    sampling_threads: int = 16,
    exlq_decode: bool = False,
    prefill_batch_tokens: int = 0,
    admit_prompt_tokens: int = 0,
    gpu_embedding: bool = False,
) -> Any:
    """The model, cache and generator, loaded as the worker loads them
    (exlq.worker.engines.exllamav2.load): exllamav2's own generator, or with exlq_decode the one
    exlq's engine runs (GPU sampling, batched prefill of prefill_batch_tokens, steps that
    start jobs of admit_prompt_tokens prompt tokens together, the embedding table on the GPU
    with gpu_embedding). Returns the LoadedGenerator; its unload() frees it."""
    loader = importlib.import_module("exlq.worker.engines.exllamav2.load")
    return loader.load_generator(
        model_dir,
        max_batch_size=concurrency,
        cache_tokens=cache_tokens,
        gpu_sampling=exlq_decode,
        prefill_batch_tokens=prefill_batch_tokens if exlq_decode else 0,
        admit_prompt_tokens=admit_prompt_tokens if exlq_decode else 0,
        gpu_embedding=gpu_embedding and exlq_decode,
        max_chunk_size=max_chunk_size,
        sampling_threads=sampling_threads,
        paged=paged,
        decode_graphs=exlq_decode,
    )


def pair_prompts(
    model_dir: str | Path, jobs: int, prompt_tokens: int, repeat: int
) -> tuple[list[list[int]], list[list[int]]]:
    """A repeat's prompts and its warm-up prompts, new for every repeat and the same for
    every system of it, so neither system's prefix cache has seen them."""
    return (
        random_prompt_ids(model_dir, jobs, prompt_tokens, seed=1 + repeat),
        random_prompt_ids(model_dir, jobs, prompt_tokens, seed=10_001 + repeat),
    )


def warm_up_jobs(generator: Any, prompts: list[list[int]]) -> None:
    """As many short jobs as the run has, on other prompts: every kernel variant the run
    needs compiles here, and the prefix cache learns nothing of the real prompts."""
    import torch

    exl_gen = importlib.import_module("exllamav2.generator")
    generator.enqueue(
        [
            exl_gen.ExLlamaV2DynamicJob(
                input_ids=torch.tensor([ids], dtype=torch.long),
                max_new_tokens=8,
                stop_conditions=[],
                gen_settings=exl_gen.ExLlamaV2Sampler.Settings.greedy(),
            )
            for ids in prompts
        ]
    )
    while generator.num_remaining_jobs():
        generator.iterate()


# Told of each timed step of a run on a dynamic generator: its begin and end (perf_counter).
StepClock = Callable[[float, float], None]


def run_dynamic(
    generator: Any,
    model_dir: str | Path,
    prompts: list[list[int]],
    max_new_tokens: int,
    seed: int,
    system: str,
    idle_s: float = IDLE_BEFORE_RUN_S,
    on_step: StepClock | None = None,
) -> dict[str, Any]:
    """One timed run on a loaded dynamic generator: the prompts enqueued at once, greedy, no
    stop conditions (no EOS), iterated until every job ends.

    The clock starts when the prompts are in hand, before their jobs are built, as exlq's
    starts when its client submits them: a server on this generator builds a job for each
    request it gets (about 0.1 ms each on the H100, exllamav2's own Python). ``build_ms``
    says how long that took. The generator idles ``idle_s`` first. ``on_step`` is told of
    each iterate() (bench.path_trace)."""
    import torch

    exl_gen = importlib.import_module("exllamav2.generator")
    settings = exl_gen.ExLlamaV2Sampler.Settings.greedy()
    torch.cuda.synchronize()
    time.sleep(idle_s)
    t0 = time.perf_counter()
    jobs = [
        exl_gen.ExLlamaV2DynamicJob(
            input_ids=torch.tensor([ids], dtype=torch.long),
            max_new_tokens=max_new_tokens,
            min_new_tokens=0,
            stop_conditions=[],  # no EOS token, no stop string: exactly max_new_tokens each
            gen_settings=settings,
            identifier=j,
            seed=seed + j,
        )
        for j, ids in enumerate(prompts)
    ]
    log = _StepLog(len(jobs))
    build_ms = (time.perf_counter() - t0) * 1000
    generator.enqueue(jobs)
    while generator.num_remaining_jobs():
        ts = time.perf_counter()
        results = generator.iterate()
        te = time.perf_counter()
        log.record(results, ts, te)
        if on_step is not None:
            on_step(ts, te)
    out = _summarize(
        system=system,
        model_dir=model_dir,
        concurrency=len(prompts),
        prompt_tokens=len(prompts[0]),
        max_new_tokens=max_new_tokens,
        t0=t0,
        t_end=log.t_end,
        token_times=log.event_times,
        completion_tokens=sum(t or 0 for t in log.final_tokens),
        first_event_tokens=log.first_event_tokens,
    )
    made = [tt[0] - t0 for tt in log.token_times if tt]
    made_itl = [b - a for tt in log.token_times for a, b in itertools.pairwise(tt)]
    out["ttft_made_ms_p50"], out["ttft_made_ms_p99"] = percentiles(_ms(made))
    out["itl_made_ms_p50"], out["itl_made_ms_p99"] = percentiles(_ms(made_itl))
    out.update(log.figures())
    out["unended_jobs"] = sum(t is None for t in log.final_tokens)
    out["build_ms"] = build_ms
    return out


def bench_exllamav2_dynamic(
    model_dir: str | Path,
    concurrency: int,
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    cache_tokens: int = 65536,
    paged: bool = True,
    max_chunk_size: int | None = None,
    seed: int = 0,
    warmup: bool = True,
    attn_patch: Callable[[], object] | None = None,
    max_batch_size: int | None = None,
    sampling_threads: int = 16,
    exlq_decode: bool = False,
    prefill_batch_tokens: int = 0,
    admit_prompt_tokens: int = 0,
    gpu_embedding: bool = False,
) -> dict[str, Any]:
    """N jobs enqueued at once into ExLlamaV2DynamicGenerator; greedy; no stop conditions (no EOS).

    attn_patch, if given, runs after exllamav2 is imported and before anything is built (e.g. to
    install a flash_attn_with_kvcache stand-in, so that paged mode works without flash-attn).
    exlq_decode runs the generator as exlq's engine does (its GPU sampling, CUDA graphs for
    1..max_batch_size jobs as the worker captures up to its capacity, batched prefill of
    prefill_batch_tokens, its admission budget of admit_prompt_tokens, the embedding table
    on the GPU with gpu_embedding), without the queue around it.
    """
    importlib.import_module("exllamav2.generator")  # attn_patch runs after exllamav2 loads
    if attn_patch is not None:
        attn_patch()
    if cache_tokens % PAGE_SIZE:
        raise ValueError(f"cache_tokens must be a multiple of {PAGE_SIZE}")
    prompts = random_prompt_ids(model_dir, concurrency, prompt_tokens, seed)

    loaded: Any = None
    try:
        _cuda_reset_peak()
        t_load = time.perf_counter()
        loaded = exl_load(
            model_dir,
            max_batch_size or concurrency,
            cache_tokens,
            paged,
            max_chunk_size,
            sampling_threads,
            exlq_decode,
            prefill_batch_tokens,
            admit_prompt_tokens,
            gpu_embedding,
        )
        generator = loaded.generator
        load_s = time.perf_counter() - t_load
        if warmup:
            # Readied as the worker's engine readies it (graphs with exlq_decode), then
            # short jobs on other prompts.
            importlib.import_module("exlq.worker.engines.exllamav2.load").warm_up(loaded)
            warm_up_jobs(
                generator, random_prompt_ids(model_dir, concurrency, prompt_tokens, seed + 1000)
            )
        else:  # a cold start still decodes from graphs (exlq_decode), as the engine would
            loaded.capture_graphs()
        out = run_dynamic(
            generator,
            model_dir,
            prompts,
            max_new_tokens,
            seed,
            system=(
                "exlq-engine"
                if exlq_decode
                else "exllamav2-dynamic" + ("" if paged else "-unpaged")
            ),
        )
        peak = _cuda_peak()
        fit = (cache_tokens // PAGE_SIZE) // math.ceil((prompt_tokens + max_new_tokens) / PAGE_SIZE)
        notes = []
        if not paged:
            notes.append("unpaged: one job at a time")
        elif fit < concurrency:
            notes.append(f"cache holds only {fit} of {concurrency} jobs at once")
        if out.pop("unended_jobs"):
            notes.append("some jobs ended without an eos result")
        out.update(
            {
                "cache_tokens": cache_tokens,
                "max_batch_size": max_batch_size or concurrency,
                "sampling_threads": sampling_threads,
                "paged": paged,
                "load_s": load_s,
                "peak_gpu_mem_bytes": peak,
                "peak_gpu_mem_gib": _gib(peak),
                "note": "; ".join(notes) or None,
            }
        )
        return out
    finally:
        if loaded is not None:
            loaded.unload()
        del loaded
        _free_gpu()


# --------------------------------------------------------------------------- (c) exllamav2 server


def _serve_websocket(model_dir: str, host: str) -> None:
    """Child process: load the model; serve ExLlamaV2WebSocketServer on a free port to SIGTERM."""
    import torch
    from websockets.asyncio.server import ServerConnection, serve

    exl = importlib.import_module("exllamav2")
    exl_server = importlib.import_module("exllamav2.server")

    cuda = _cuda_reset_peak()
    t_load = time.perf_counter()
    config = exl.ExLlamaV2Config(model_dir)
    model = exl.ExLlamaV2(config, lazy_load=True)
    # batch 1 and config.max_seq_len tokens, as the server expects
    cache = exl.ExLlamaV2Cache(model, lazy=True)
    model.load_autosplit(cache, progress=False)
    tokenizer = exl.ExLlamaV2Tokenizer(config)
    server = exl_server.ExLlamaV2WebSocketServer(host, 0, model, tokenizer, cache)
    load_s = time.perf_counter() - t_load

    async def handler(ws: ServerConnection) -> None:
        # ExLlamaV2WebSocketServer.main(websocket, path) predates websockets 13's one-argument
        # handlers; it runs as is: a task per message, actions.dispatch under its model lock.
        await server.main(ws, None)

    async def run() -> None:
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        async with serve(handler, host, 0, max_size=None) as srv:
            port = srv.sockets[0].getsockname()[1]
            print(f"{WS_READY} {port} {load_s:.3f}", flush=True)
            await stop.wait()
        peak = int(torch.cuda.max_memory_allocated()) if cuda else None
        print(f"{WS_STATS} {json.dumps({'peak_gpu_mem_bytes': peak})}", flush=True)

    asyncio.run(run())


async def _ws_drive(
    uri: str, requests: list[dict[str, Any]], timeout_s: float
) -> tuple[float, float, list[list[float]], list[dict[str, Any]]]:
    """Run every request at once; after timeout_s, stop and report what finished.

    Requests cut off by the window come back with their chunk times so far and
    ``stop_reason`` "window" (no tokens counted for them)."""
    from websockets.asyncio.client import ClientConnection, connect

    conns: list[ClientConnection] = [await connect(uri, max_size=None) for _ in requests]
    try:

        async def one(
            ws: ClientConnection, req: dict[str, Any], times: list[float]
        ) -> tuple[list[float], dict[str, Any]]:
            await ws.send(json.dumps(req))
            async for raw in ws:
                now = time.perf_counter()
                msg = json.loads(raw)
                if msg.get("response_type") == "chunk":
                    times.append(now)
                elif msg.get("response_type") == "full":
                    msg.pop("util_text", None)
                    msg["_t"] = now
                    return times, msg
            raise RuntimeError("websocket closed before the full response")

        await asyncio.sleep(IDLE_BEFORE_RUN_S)
        t0 = time.perf_counter()
        partial: list[list[float]] = [[] for _ in requests]

        async def tracked(
            j: int, ws: ClientConnection, req: dict[str, Any]
        ) -> tuple[list[float], dict[str, Any]]:
            times, msg = await one(ws, req, partial[j])
            return times, msg

        tasks = [
            asyncio.create_task(tracked(j, ws, r))
            for j, (ws, r) in enumerate(zip(conns, requests, strict=True))
        ]
        await asyncio.wait(tasks, timeout=timeout_s)
        res: list[tuple[list[float], dict[str, Any]]] = []
        for j, task in enumerate(tasks):
            if task.done() and task.exception() is None:
                res.append(task.result())
            else:
                task.cancel()
                res.append((partial[j], {"stop_reason": "window", "_t": None}))
        ends = [m["_t"] for _, m in res if m["_t"] is not None]
        t_end = max(ends) if ends else time.perf_counter()
        return t0, t_end, [t for t, _ in res], [m for _, m in res]
    finally:
        for ws in conns:
            await ws.close()


class _ServerProcess:
    """The websocket server child: started on enter (waits for its READY line), SIGTERM on exit."""

    def __init__(
        self,
        model_dir: str | Path,
        host: str,
        python: str | None,
        env: dict[str, str] | None,
        ready_timeout_s: float,
        cpus: frozenset[int] | None = None,
    ) -> None:
        script = str(Path(__file__).resolve())
        self.cpus = cpus
        self.cmd = [python or sys.executable, script, "_serve-ws", "--model", str(model_dir)]
        self.cmd += ["--host", host]
        self.env = {**os.environ, **(env or {})}
        self.ready_timeout_s = ready_timeout_s
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.proc: subprocess.Popen[str] | None = None
        self.port = 0
        self.load_s: float | None = None
        self.peak_gpu_mem_bytes: int | None = None

    def _pump(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def __enter__(self) -> _ServerProcess:
        from bench.placement import on_cpus  # this file also runs as the server's script

        with on_cpus(self.cpus):  # the child inherits this thread's CPUs
            self.proc = subprocess.Popen(self.cmd, stdout=subprocess.PIPE, text=True, env=self.env)
        threading.Thread(target=self._pump, daemon=True).start()
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while not self.port:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
                if line is None:
                    raise RuntimeError(f"websocket server exited early (rc={self.proc.wait()})")
                if line.startswith(WS_READY):
                    _, port, load_s = line.split()
                    self.port, self.load_s = int(port), float(load_s)
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        while True:
            try:
                line = self.lines.get(timeout=5)
            except queue.Empty:
                break
            if line is None:
                break
            if line.startswith(WS_STATS):
                self.peak_gpu_mem_bytes = json.loads(line[len(WS_STATS) :])["peak_gpu_mem_bytes"]


def bench_exllamav2_websocket(
    model_dir: str | Path,
    concurrency: int,
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    seed: int = 0,
    host: str = "127.0.0.1",
    timeout_s: float = 1800.0,
    python: str | None = None,
    env: dict[str, str] | None = None,
    ready_timeout_s: float = 900.0,
    server_cpus: frozenset[int] | None = None,
) -> dict[str, Any]:
    """N concurrent websocket clients, one streamed `infer` request each, on exllamav2's own server.

    The server runs in a child process (its own CUDA context and GPU memory; no attention patch
    of this process leaks into it). It serves one request at a time (a global asyncio model lock)
    with the older ExLlamaV2StreamingGenerator, so later clients queue behind earlier ones.
    """
    cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    eos_id = int(cfg["eos_token_id"])
    texts = texts_with_token_count(model_dir, concurrency, prompt_tokens, seed)
    requests = [
        {
            "action": "infer",
            "request_id": str(j),
            "text": t,
            "max_new_tokens": max_new_tokens,
            "stream": True,
            "stream_full": False,
            "temperature": 1.0,
            "top_k": 1,  # greedy, as the other drivers
            "top_p": 0.0,
            "min_p": 0.0,
            "typical": 0.0,
            "rep_pen": 1.0,
            "freq_pen": 0.0,
            "pres_pen": 0.0,
            "token_healing": False,
            "bann_bann": [eos_id],  # logit bias -inf on EOS: the stop condition can never fire
        }
        for j, t in enumerate(texts)
    ]

    with _ServerProcess(model_dir, host, python, env, ready_timeout_s, server_cpus) as srv:
        uri = f"ws://{host}:{srv.port}"
        t0, t_end, times, finals = asyncio.run(_ws_drive(uri, requests, timeout_s))
    peak = srv.peak_gpu_mem_bytes

    reasons = [str(m.get("stop_reason")) for m in finals]
    completion = sum(max_new_tokens for r in reasons if r == "num_tokens")
    out = _summarize(
        system="exllamav2-websocket",
        model_dir=model_dir,
        concurrency=concurrency,
        prompt_tokens=prompt_tokens,
        max_new_tokens=max_new_tokens,
        t0=t0,
        t_end=t_end,
        token_times=times,
        completion_tokens=completion,
    )
    chunks = sum(len(t) for t in times)
    note = (
        "EOS suppressed with bann_bann=[eos] (token bias -inf); each request stops after exactly "
        "max_new_tokens stream() calls (stop_reason num_tokens). Times are of chunk messages: a "
        "chunk is sent only when its text is non-empty (partial UTF-8 is held), so ITL is per "
        "chunk, not per token. Every chunk message also carries util_text (the whole prompt). "
        "Requests run one at a time under the server's model lock."
    )
    cut = reasons.count("window")
    if cut:
        note += (
            f" Measured over a {timeout_s:.0f} s window: {cut} of {concurrency} requests had "
            "not finished and count no tokens; tokens/s is over the finished ones up to the "
            "last finish, and TTFT percentiles cover only requests that got a first chunk."
        )
    bad = [r for r in reasons if r not in ("num_tokens", "window")]
    if bad:
        note += f" Unexpected stop reasons: {sorted(set(bad))} (counted as 0 tokens)."
    out.update(
        {
            "chunks": chunks,
            "stop_reasons": {r: reasons.count(r) for r in sorted(set(reasons))},
            "load_s": srv.load_s,
            "peak_gpu_mem_bytes": peak,
            "peak_gpu_mem_gib": _gib(peak),
            "note": note,
        }
    )
    return out


# --------------------------------------------------------------------------- (d) transformers


def bench_transformers(
    model_dir: str | Path,
    concurrency: int,
    prompt_tokens: int,
    max_new_tokens: int,
    *,
    device: str = "cuda",
    mode: str = "auto",
    attn_implementation: str | None = None,
    cache_tokens: int | None = 65536,
    max_batch_tokens: int | None = None,
    seed: int = 0,
    warmup: bool = True,
) -> dict[str, Any]:
    """transformers on the same checkpoint in fp16: continuous batching, else batched generate.

    mode: "cb" (ContinuousBatchingManager from model.init_continuous_batching), "generate" (one
    batch, min_new_tokens = max_new_tokens), or "auto" (cb when init_continuous_batching exists).
    cache_tokens sizes the CB paged cache (num_blocks = cache_tokens / 256); None: transformers'
    default (a share of free GPU memory). max_batch_tokens caps the tokens of one CB forward pass
    (None: transformers solves it from free GPU memory; on CPU, where it cannot, 2048).
    """
    import torch
    from transformers import AutoModelForCausalLM

    prompts = random_prompt_ids(model_dir, concurrency, prompt_tokens, seed)
    model: Any = None
    try:
        _cuda_reset_peak()
        t_load = time.perf_counter()
        kwargs: dict[str, Any] = {"dtype": torch.float16}
        if attn_implementation is not None:
            kwargs["attn_implementation"] = attn_implementation
        auto: Any = AutoModelForCausalLM  # from_pretrained's stubs are wrong for a str path
        model = auto.from_pretrained(str(model_dir), **kwargs).to(device).eval()
        load_s = time.perf_counter() - t_load

        use_cb = mode == "cb" or (mode == "auto" and hasattr(model, "init_continuous_batching"))
        if use_cb:
            if max_batch_tokens is None and not device.startswith("cuda"):
                max_batch_tokens = 2048
            out = _hf_continuous_batching(
                model, prompts, max_new_tokens, cache_tokens, max_batch_tokens, warmup, device
            )
        elif mode in ("generate", "auto"):
            out = _hf_generate(model, prompts, max_new_tokens, warmup, device)
        else:
            raise ValueError(f"unknown mode {mode!r}")
        figures = _summarize(
            system="transformers-" + ("cb" if use_cb else "generate"),
            model_dir=model_dir,
            concurrency=concurrency,
            prompt_tokens=prompt_tokens,
            max_new_tokens=max_new_tokens,
            t0=out.pop("t0"),
            t_end=out.pop("t_end"),
            token_times=out.pop("token_times"),
            completion_tokens=out.pop("completion_tokens"),
        )
        peak = _cuda_peak()
        figures.update(out)
        figures.update(
            {
                "device": device,
                "attn_implementation": str(model.config._attn_implementation),
                "load_s": load_s,
                "peak_gpu_mem_bytes": peak,
                "peak_gpu_mem_gib": _gib(peak),
            }
        )
        return figures
    finally:
        if model is not None and hasattr(model, "destroy_cached_continuous_batching_manager"):
            model.destroy_cached_continuous_batching_manager()
        del model
        _free_gpu()


def _hf_continuous_batching(
    model: Any,
    prompts: list[list[int]],
    max_new_tokens: int,
    cache_tokens: int | None,
    max_batch_tokens: int | None,
    warmup: bool,
    device: str,
) -> dict[str, Any]:
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    n = len(prompts)
    gen_cfg = GenerationConfig(  # type: ignore[no-untyped-call, unused-ignore]
        max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
    )
    cb_kwargs: dict[str, Any] = {"max_requests_per_batch": n}
    if cache_tokens is not None:
        cb_kwargs["num_blocks"] = max(1, math.ceil(cache_tokens / 256))
    if max_batch_tokens is not None:
        cb_kwargs["max_batch_tokens"] = max_batch_tokens
    cb_cfg = ContinuousBatchingConfig(**cb_kwargs)
    hints = WorkloadHints(
        max_prompt_length=max(len(p) for p in prompts),
        max_generated_length=max_new_tokens,
        num_requests=n,
    )
    manager = model.init_continuous_batching(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, workload_hints=hints
    )
    try:
        if warmup and device.startswith("cuda"):
            manager.warmup()  # captures CUDA graphs
        manager.start()
        attn_used = str(model.config._attn_implementation)
        results: dict[str, Any] = {}
        time.sleep(IDLE_BEFORE_RUN_S)
        t0 = time.perf_counter()
        ids = [
            manager.add_request(
                input_ids=p,
                request_id=f"r{j}",
                max_new_tokens=max_new_tokens,
                record_timestamps=True,
                eos_token_id=-1,  # -1: no EOS
            )
            for j, p in enumerate(prompts)
        ]
        while len(results) < n:
            res = manager.get_result(timeout=1)
            if res is None:
                if not manager.is_running():
                    raise RuntimeError("transformers CB generation thread stopped")
                continue
            if res.is_finished():
                results[res.request_id] = res
        t_wall_end = time.perf_counter()
    finally:
        manager.stop(block=True, timeout=30)
        manager.destroy()

    errors = [results[i].error for i in ids if results[i].error is not None]
    if errors:
        raise RuntimeError(f"transformers CB: {len(errors)} of {n} requests failed: {errors[0]}")
    token_times = [list(results[i].timestamps or []) for i in ids]
    completion = sum(len(results[i].generated_tokens) for i in ids)
    ends = [results[i].lifespan[1] for i in ids if results[i].lifespan[1] > 0]
    t_end = max(ends) if ends else t_wall_end
    cfg = manager.continuous_batching_config
    return {
        "t0": t0,
        "t_end": t_end,
        "token_times": token_times,
        "completion_tokens": completion,
        "attn_implementation_used": attn_used,
        "timestamps_match_tokens": all(
            len(results[i].timestamps or []) == len(results[i].generated_tokens) for i in ids
        ),
        "cb_num_blocks": getattr(cfg, "num_blocks", None),
        "cb_max_batch_tokens": getattr(cfg, "max_batch_tokens", None),
        "cb_max_requests_per_batch": getattr(cfg, "max_requests_per_batch", None),
        "note": (
            "ContinuousBatchingManager, greedy, eos_token_id=-1; token times from "
            "record_timestamps (per token, taken when the token is sampled)"
        ),
    }


def _hf_generate(
    model: Any, prompts: list[list[int]], max_new_tokens: int, warmup: bool, device: str
) -> dict[str, Any]:
    import torch
    from transformers import StoppingCriteria, StoppingCriteriaList

    cuda = device.startswith("cuda")
    step_times: list[float] = []

    class _Clock(StoppingCriteria):  # type: ignore[misc, unused-ignore]
        """Called once per step, after the step's tokens are appended: timestamps each step."""

        def __call__(
            self, input_ids: torch.LongTensor, scores: Any, **kwargs: Any
        ) -> torch.BoolTensor:
            if cuda:
                torch.cuda.synchronize()
            step_times.append(time.perf_counter())
            return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)  # type: ignore[return-value, unused-ignore]

    # Equal-length prompts: no padding needed (left padding would be used otherwise).
    input_ids = torch.tensor(prompts, dtype=torch.long, device=device)
    mask = torch.ones_like(input_ids)
    gen_kwargs: dict[str, Any] = {
        "attention_mask": mask,
        "max_new_tokens": max_new_tokens,
        "min_new_tokens": max_new_tokens,  # EOS suppressed until max_new_tokens
        "do_sample": False,
        "pad_token_id": 0,
    }
    with torch.inference_mode():
        if warmup:
            short = {"attention_mask": mask[:, :8], "max_new_tokens": 4, "min_new_tokens": 4}
            model.generate(input_ids[:, :8], **{**gen_kwargs, **short})
            step_times.clear()
        if cuda:
            torch.cuda.synchronize()
        time.sleep(IDLE_BEFORE_RUN_S)
        t0 = time.perf_counter()
        clock = StoppingCriteriaList([_Clock()])
        out = model.generate(input_ids, stopping_criteria=clock, **gen_kwargs)
        if cuda:
            torch.cuda.synchronize()
        t_end = time.perf_counter()
    new = int(out.shape[1] - input_ids.shape[1])
    return {
        "t0": t0,
        "t_end": t_end,
        "token_times": [list(step_times) for _ in prompts],
        "completion_tokens": new * len(prompts),
        "step_ms_median": percentiles(
            _ms([b - a for a, b in itertools.pairwise(step_times)]), [50]
        )[0],
        "note": "one static batch through generate(); TTFT = time to the whole batch's first step",
    }


# --------------------------------------------------------------------------- CLI


def _load_callable(spec: str) -> Callable[[], object]:
    mod, _, name = spec.partition(":")
    fn = getattr(importlib.import_module(mod), name)
    if not callable(fn):
        raise TypeError(f"{spec} is not callable")
    return fn  # type: ignore[no-any-return]


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)

    def point(p: argparse.ArgumentParser) -> None:
        p.add_argument("--model", required=True)
        p.add_argument("-n", "--concurrency", type=int, default=8)
        p.add_argument("-p", "--prompt-tokens", type=int, default=256)
        p.add_argument("-m", "--max-new-tokens", type=int, default=128)
        p.add_argument("--seed", type=int, default=0)

    p_exl = sub.add_parser("exl", help="(a) bare ExLlamaV2DynamicGenerator")
    point(p_exl)
    p_exl.add_argument("--cache-tokens", type=int, default=65536)
    p_exl.add_argument("--no-paged", action="store_true")
    p_exl.add_argument("--no-warmup", action="store_true")
    p_exl.add_argument("--patch", help="module:function to call after importing exllamav2")

    p_ws = sub.add_parser("ws", help="(c) exllamav2's websocket server")
    point(p_ws)

    p_hf = sub.add_parser("hf", help="(d) transformers")
    point(p_hf)
    p_hf.add_argument("--device", default="cuda")
    p_hf.add_argument("--mode", choices=["auto", "cb", "generate"], default="auto")
    p_hf.add_argument("--attn", default=None)
    p_hf.add_argument("--cache-tokens", type=int, default=65536)
    p_hf.add_argument("--max-batch-tokens", type=int, default=None)
    p_hf.add_argument("--no-warmup", action="store_true")

    p_floor = sub.add_parser("floor", help="memory-bandwidth floor of one decode step")
    p_floor.add_argument("--model", required=True)
    p_floor.add_argument("--bandwidth", type=float, default=4.8e12, help="bytes/s (H200: 4.8e12)")

    p_srv = sub.add_parser("_serve-ws")  # internal: the websocket server child
    p_srv.add_argument("--model", required=True)
    p_srv.add_argument("--host", default="127.0.0.1")

    a = ap.parse_args(argv)
    res: dict[str, Any]
    if a.cmd == "_serve-ws":
        _serve_websocket(a.model, a.host)
        return
    if a.cmd == "floor":
        res = {
            "weight_bytes": weight_bytes(a.model),
            "floor_ms": memory_bandwidth_floor_ms(a.model, a.bandwidth),
            "bandwidth": a.bandwidth,
        }
    elif a.cmd == "exl":
        res = bench_exllamav2_dynamic(
            a.model,
            a.concurrency,
            a.prompt_tokens,
            a.max_new_tokens,
            cache_tokens=a.cache_tokens,
            paged=not a.no_paged,
            seed=a.seed,
            warmup=not a.no_warmup,
            attn_patch=_load_callable(a.patch) if a.patch else None,
        )
    elif a.cmd == "ws":
        res = bench_exllamav2_websocket(
            a.model, a.concurrency, a.prompt_tokens, a.max_new_tokens, seed=a.seed
        )
    else:
        res = bench_transformers(
            a.model,
            a.concurrency,
            a.prompt_tokens,
            a.max_new_tokens,
            device=a.device,
            mode=a.mode,
            attn_implementation=a.attn,
            cache_tokens=a.cache_tokens,
            max_batch_tokens=a.max_batch_tokens,
            seed=a.seed,
            warmup=not a.no_warmup,
        )
    print(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()

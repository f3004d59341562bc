"""WorkerSettings: every knob of the worker, from flags and EXLQ_* environment variables."""

from __future__ import annotations

import os
import socket
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from exlq.protocol.keys import DEFAULT_PREFIX, check_name

EngineName = Literal["exllamav2", "echo"]
AttentionChoice = Literal["auto", "flash-attn", "exlq"]
EngineRunnerChoice = Literal["process", "thread"]


def default_consumer_name() -> str:
    """Says where the worker runs, so an operator can tell who holds a pending entry."""
    return f"{socket.gethostname()}:{os.getpid()}"


class WorkerSettings(BaseSettings):
    """Flags override environment variables (EXLQ_<FIELD>), which override the defaults."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_", extra="forbid", frozen=True)

    redis_url: str = "redis://localhost:6379/0"
    engine: EngineName = "exllamav2"
    model: Path | None = Field(None, description="model directory (exllamav2 engine)")
    queue: str | None = Field(None, description="queue name; defaults to the model's name")
    prefix: str = DEFAULT_PREFIX
    consumer_name: str = Field(default_factory=default_consumer_name)

    max_batch_size: int = Field(32, ge=1, le=1024, description="jobs run at once")
    cache_tokens: int = Field(65_536, ge=256, description="KV cache size in tokens")
    max_chunk_size: int = Field(2048, ge=64, description="prefill tokens per iteration")
    attention: AttentionChoice = "auto"
    engine_runner: EngineRunnerChoice = Field(
        "process", description="run the engine in a process of its own, or on a thread"
    )
    cuda_graphs: bool = Field(
        True, description="replay the decode step from CUDA graphs (fp16 and EXL2 models, one GPU)"
    )
    gpu_sampling: bool = Field(
        True, description="sample greedy/temperature/top_k/min_p jobs on the GPU in one batch"
    )
    gpu_embedding: bool = Field(
        True,
        description="keep the token-embedding table on the GPU (vocab x hidden x 2 bytes, "
        "1 GB for an 8B Llama 3); off: in system memory as exllamav2 loads it, where each "
        "prefill pass gathers its rows on the CPU",
    )
    overlap_reports: bool = Field(
        True,
        description="send a step's tokens while the next step waits for the GPU, except a "
        "job's first text and its end, which go at once; off: every step's tokens as soon "
        "as the step ends",
    )
    admit_in_wait: bool = Field(
        True,
        description="while the GPU runs a step, take in the jobs that have arrived and build "
        "the ones the next step will start; off: both between steps",
    )
    offer_before_start: bool = Field(
        True,
        description="offer a piece's jobs to the engine as they are parsed, so it checks and "
        "builds them while Redis runs the start script; off: the engine hears of them after it",
    )
    admit_before_start: bool = Field(
        True,
        description="start a piece's offered jobs once they are all offered, while Redis "
        "runs the start script, and stop the ones it refuses, unseen; off: the engine "
        "starts them after the script (needs offer_before_start)",
    )
    prefill_batch_tokens: int = Field(
        4096,
        ge=0,
        le=65_536,
        description="prompt tokens (padding included) one batched prefill pass takes; 0: one "
        "pass per job, as exllamav2 does",
    )
    admit_prompt_tokens: int = Field(
        8192,
        ge=0,
        le=1_048_576,
        description="prompt tokens the jobs one step starts may hold together; more wait for "
        "the next step (a longer prompt starts alone); 0: every job that fits, as exllamav2 "
        "does",
    )
    sampling_threads: int = Field(
        1,
        ge=1,
        le=64,
        description="exllamav2 sampling threads (with gpu_sampling off); 1 measured fastest",
    )

    echo_tokens_per_second: float = Field(50.0, gt=0, description="echo engine speed per job")

    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(9400, ge=0, le=65535, description="0 picks a free port")
    grace_seconds: float = Field(30.0, ge=0)
    result_ttl_seconds: int = Field(24 * 3600, ge=1)
    dead_stream_max_len: int = Field(10_000, ge=1)
    read_block_ms: int = Field(1000, ge=10)
    burst_wait_ms: int = Field(
        20,
        ge=0,
        le=10_000,
        description="the longest a worker waits for the rest of a burst when the last entry "
        "it read says more follows (the SDK's field more=1), so that the burst starts in one "
        "engine pass; the rest normally lands within 1-2 ms; 0: never waits",
    )
    heartbeat_seconds: float = Field(5.0, gt=0)
    claim_idle_ms: int = Field(
        30_000, ge=100, description="an entry this long without its owner's renewal is rerun"
    )
    max_attempts: int = Field(3, ge=1, le=100, description="runs of one job before it is dead")
    trim_interval_seconds: float = Field(10.0, gt=0)

    max_request_bytes: int = Field(1_000_000, ge=256, description="size of one stream entry")
    max_prompt_chars: int = Field(400_000, ge=1, description="prompt, or all messages together")
    max_messages: int = Field(512, ge=1)
    max_metadata_bytes: int = Field(16_384, ge=0)
    max_new_tokens: int = Field(8192, ge=1, le=65_536, description="largest max_new_tokens")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if self.engine == "exllamav2" and self.model is None:
            raise ValueError("the exllamav2 engine needs --model DIR (or EXLQ_MODEL)")
        if self.model is not None and not self.model.is_dir():
            raise ValueError(f"model directory {str(self.model)!r} does not exist")
        check_name("queue name", self.queue_name)
        check_name("key prefix", self.prefix)
        return self

    @property
    def claim_renew_seconds(self) -> float:
        """How often a worker renews its claim on the jobs it runs: well inside the idle time."""
        return self.claim_idle_ms / 1000 / 4

    @property
    def queue_name(self) -> str:
        if self.queue:
            return self.queue
        if self.model is not None:
            return self.model.resolve().name
        return "default"

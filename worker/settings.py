"""A worker's settings, one small object per concern, from flags and EXLQ_* variables.

``BrokerSettings`` is how the worker uses Redis, ``ServingSettings`` what it serves and how
it runs, ``RequestLimits`` (limits.py) what it accepts; the chosen engine brings its own
settings (engines/registry.py). Each reads the environment variable ``EXLQ_<FIELD>``; a
flag overrides it. ``WorkerSettings.load`` builds them together and refuses a combination
in which a setting would do nothing.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, SecretStr, ValidationError
from pydantic_settings import BaseSettings, SettingsConfigDict

from exlq.logs import LogFormat
from exlq.protocol.keys import DEFAULT_PREFIX, check_name
from exlq.protocol.partition_count import MAX_PARTITIONS
from exlq.worker.engines.model_format import AUTO, engine_for
from exlq.worker.engines.registry import EngineSpec, LoadRequest, find
from exlq.worker.lanes import LanePolicy
from exlq.worker.limits import RequestLimits

EngineRunnerChoice = Literal["process", "thread"]


def default_consumer_name() -> str:
    """Says where the worker runs, so an operator can tell who holds a pending entry."""
    return f"{socket.gethostname()}:{os.getpid()}"


class BrokerSettings(BaseSettings):
    """How the worker reads, claims and finishes jobs in Redis."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_", extra="forbid", frozen=True)

    redis_url: str = "redis://localhost:6379/0"
    redis_username: str | None = Field(
        None, description="Redis ACL user; overrides the URL's (exlq/protocol/redis_credentials)"
    )
    redis_password: SecretStr | None = Field(
        None,
        description="Redis password, as it is (no percent-encoding); overrides the URL's. "
        "Empty: none",
    )
    queue: str | None = Field(None, description="queue name; defaults to the model's name")
    prefix: str = DEFAULT_PREFIX
    consumer_name: str = Field(default_factory=default_consumer_name)
    partitions: int = Field(
        1,
        ge=1,
        le=MAX_PARTITIONS,
        description="split the queue in this many partitions (streams in different slots of "
        "a Redis Cluster), for a queue hotter than one shard; a worker raises the queue's "
        "count to this, never lowers it, and reads every partition (docs/SCALING.md)",
    )
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
    result_ttl_seconds: int = Field(24 * 3600, ge=1)
    dead_stream_max_len: int = Field(10_000, ge=1)

    @property
    def claim_renew_seconds(self) -> float:
        """How often a worker renews its claim on the jobs it runs: well inside the idle time."""
        return self.claim_idle_ms / 1000 / 4


class ServingSettings(BaseSettings):
    """What the worker serves, and how its processes run."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_", extra="forbid", frozen=True)

    engine: str = Field(
        AUTO,
        description="engine name (`exlq engines` lists them); auto: the model's format picks "
        "it (worker/engines/model_format.py)",
    )
    model: Path | None = Field(None, description="model directory or file")
    max_batch_size: int = Field(32, ge=1, le=1024, description="jobs run at once")
    engine_runner: EngineRunnerChoice = Field(
        "process",
        description="run the engine in a process of its own, or on a thread of the worker's "
        "(slower: the engine's step then shares the interpreter lock with Redis I/O)",
    )
    batch_min_slots: int = Field(
        1,
        ge=0,
        le=1024,
        description="slots the batch lane may always use, however busy the interactive lane "
        "is: while batch jobs wait, at least this many run (worker/lanes.py)",
    )
    interactive_reserved_slots: int | None = Field(
        None,
        ge=0,
        le=1024,
        description="slots the batch lane leaves free for interactive jobs, so that one "
        "arriving during a batch starts at once; default: an eighth of max_batch_size",
    )
    metrics_host: str = "127.0.0.1"
    metrics_port: int = Field(9400, ge=0, le=65535, description="0 picks a free port")
    grace_seconds: float = Field(30.0, ge=0, description="time running jobs get on SIGTERM")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"
    log_format: LogFormat = Field("text", description="text lines, or one JSON object a line")
    trace_file: Path | None = Field(
        None,
        description="append a JSON line for each stage of a job's path, from both of the "
        "worker's processes, to this file (worker/tracing.py); for benchmarks only",
    )


@dataclass(frozen=True)
class WorkerSettings:
    broker: BrokerSettings
    serving: ServingSettings
    limits: RequestLimits
    engine_options: BaseModel

    @classmethod
    def load(cls, engine_options: Mapping[str, Any] | None = None, **flags: Any) -> WorkerSettings:
        """Settings from flags (each routed to its group by name; None: not given) over
        EXLQ_* variables, and the engine's options (NAME=VALUE) over its variables. Raises
        ValueError naming every problem."""
        given = {name: value for name, value in flags.items() if value is not None}
        groups: dict[str, dict[str, Any]] = {"broker": {}, "serving": {}, "limits": {}}
        fields = {
            "broker": BrokerSettings.model_fields,
            "serving": ServingSettings.model_fields,
            "limits": RequestLimits.model_fields,
        }
        for name, value in given.items():
            group = next((g for g, known in fields.items() if name in known), None)
            if group is None:
                raise ValueError(f"unknown setting {name!r}")
            groups[group][name] = value
        try:
            broker = BrokerSettings(**groups["broker"])
            serving = ServingSettings(**groups["serving"])
            limits = RequestLimits(**groups["limits"])
        except ValidationError as exc:
            raise ValueError(_problems(exc)) from None
        if serving.engine == AUTO:
            serving = serving.model_copy(update={"engine": engine_for(serving.model)})
        spec = find(serving.engine)
        settings = cls(broker, serving, limits, spec.options(engine_options or {}))
        settings.check(spec)
        return settings

    def check(self, spec: EngineSpec) -> None:
        """Settings that only make sense together."""
        model = self.serving.model
        if spec.needs_model and model is None:
            raise ValueError(f"the {spec.name} engine needs --model PATH (or EXLQ_MODEL)")
        if not spec.needs_model and model is not None:
            raise ValueError(f"the {spec.name} engine takes no model; drop --model")
        if model is not None and not model.exists():
            raise ValueError(f"model {str(model)!r} does not exist")
        check_name("queue name", self.queue_name)
        check_name("key prefix", self.broker.prefix)

    @property
    def queue_name(self) -> str:
        if self.broker.queue:
            return self.broker.queue
        model = self.serving.model
        if model is not None:
            resolved = model.resolve()
            return resolved.stem if resolved.is_file() else resolved.name
        return "default"

    def lane_policy(self, capacity: int) -> LanePolicy:
        """How a worker of ``capacity`` slots shares them between the priority lanes."""
        reserved = self.serving.interactive_reserved_slots
        if reserved is None:
            reserved = capacity // 8
        return LanePolicy(capacity, self.serving.batch_min_slots, min(reserved, capacity))

    def load_request(self) -> LoadRequest:
        """What the engine is built from."""
        return LoadRequest(self.serving.model, self.serving.max_batch_size, self.engine_options)


def _problems(exc: ValidationError) -> str:
    return "; ".join(
        f"{'.'.join(str(p) for p in err['loc']) or 'settings'}: {err['msg']}"
        for err in exc.errors(include_url=False)
    )

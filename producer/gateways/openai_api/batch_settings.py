"""The Batch API's limits and pacing, from EXLQ_BATCH_* variables."""

from __future__ import annotations

from typing import Any

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# Redis refuses a single value over its proto-max-bulk-len (deploy/redis/redis.conf: 2 MB),
# so a file is stored as a list of pieces no larger than this, and streamed back piece by
# piece.
FILE_CHUNK_BYTES = 512 * 1024


class BatchSettings(BaseSettings):
    """Sizes the gateway accepts, and how its batch runner paces and leases its work."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_BATCH_", extra="forbid", frozen=True)

    max_file_bytes: int = Field(
        64 * 1024 * 1024,
        ge=1,
        description="largest file an upload may carry (OpenAI's: 200 MB); held in Redis",
    )
    max_requests: int = Field(
        50_000, ge=1, description="most request lines in one batch's input file (OpenAI's)"
    )
    max_line_bytes: int = Field(
        1_000_000,
        ge=256,
        le=1_500_000,
        description="largest request line: its job must fit one Redis value and a worker's "
        "max_request_bytes",
    )
    completion_window_s: float = Field(
        24 * 3600.0,
        gt=0,
        description="what the API's only window, '24h', lasts; shorter only for tests",
    )
    lease_ms: int = Field(
        30_000, ge=100, description="a replica's hold on a batch; a dead one's lapses after it"
    )
    poll_interval_s: float = Field(
        1.0, gt=0, description="how often a runner looks at the open batches"
    )
    submit_chunk: int = Field(256, ge=1, description="request lines submitted per step")
    max_in_flight_jobs: int = Field(
        4096, ge=1, description="jobs one batch may have queued or running at once"
    )
    read_chunk: int = Field(1000, ge=1, description="lines or results read from Redis per command")


_defaults: BatchSettings | None = None


def batch_settings_of(state: Any) -> BatchSettings:
    """The app's BatchSettings (``app.state.batch_settings``), else the environment's."""
    found = getattr(state, "batch_settings", None)
    if isinstance(found, BatchSettings):
        return found
    global _defaults
    if _defaults is None:
        _defaults = BatchSettings()
    return _defaults

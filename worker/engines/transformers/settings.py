"""The transformers engine's options: `-o NAME=VALUE` or EXLQ_TRANSFORMERS_<NAME>."""

from __future__ import annotations

from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

DeviceChoice = Literal["auto", "cpu", "cuda"]
DtypeChoice = Literal["auto", "float32", "bfloat16", "float16"]


class TransformersSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXLQ_TRANSFORMERS_", extra="forbid", frozen=True)

    device: DeviceChoice = Field("auto", description="auto: cuda if torch sees a GPU, else cpu")
    dtype: DtypeChoice = Field(
        "auto",
        description="weights and activations; auto: float32 on the CPU, bfloat16 on a GPU "
        "that has it, else float16",
    )
    threads: int = Field(
        0, ge=0, le=1024, description="torch's CPU threads; 0: torch's default (the cores)"
    )
    max_seq_len: int = Field(
        0,
        ge=0,
        description="tokens one job may hold, prompt and max_new_tokens together; 0: the "
        "model's context length",
    )
    prefill_batch_tokens: int = Field(
        4096,
        ge=1,
        le=1_048_576,
        description="prompt tokens (padding included) one step prefills together; the jobs "
        "behind wait for the next step, a longer prompt goes alone",
    )

"""The exllamav3 engine's options: `-o NAME=VALUE` or EXLQ_EXLLAMAV3_<NAME>."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

# exllamav3's cache is paged in pages of this many tokens; its size is a whole number of them.
PAGE_TOKENS = 256


class ExLlamaV3Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXLQ_EXLLAMAV3_", extra="forbid", frozen=True)

    cache_tokens: int = Field(
        65_536,
        ge=PAGE_TOKENS,
        multiple_of=PAGE_TOKENS,
        description="KV cache size in tokens (a multiple of 256): every running job's prompt "
        "and output, and the prefixes kept for reuse",
    )
    max_chunk_size: int = Field(
        2048,
        ge=PAGE_TOKENS,
        multiple_of=PAGE_TOKENS,
        description="prompt tokens one prefill pass takes (a multiple of 256); a longer "
        "prompt is read in several",
    )

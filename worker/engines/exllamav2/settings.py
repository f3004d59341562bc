"""The exllamav2 engine's options: `-o NAME=VALUE` or EXLQ_EXLLAMAV2_<NAME>."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

AttentionChoice = Literal["auto", "flash-attn", "exlq"]


class ExLlamaV2Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="EXLQ_EXLLAMAV2_", extra="forbid", frozen=True)

    cache_tokens: int = Field(65_536, ge=256, description="KV cache size in tokens")
    max_chunk_size: int = Field(2048, ge=64, description="prefill tokens per iteration")
    attention: AttentionChoice = Field(
        "auto", description="auto: flash-attn >= 2.5.7 if installed, else exlq's own kernel"
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
        "1 GB for an 8B Llama 3); off: in system memory, where each prefill pass gathers "
        "its rows on the CPU",
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
        "the next step (a longer prompt starts alone); 0: every job that fits",
    )
    draft_model: Path | None = Field(
        None,
        description="a smaller model of the same vocabulary that drafts tokens for the model "
        "to verify (speculative decoding); its cache is as large as the model's",
    )
    ngram_draft: bool = Field(
        False,
        description="draft tokens from n-grams of the job's own text (speculative decoding "
        "without a draft model; pays off where output repeats its prompt)",
    )
    draft_tokens: int = Field(
        4, ge=1, le=8, description="tokens drafted a step, with a draft model or n-grams"
    )
    gpu_split: str = Field(
        "auto",
        pattern=r"^(auto|\d+(\.\d+)?(,\d+(\.\d+)?)*)$",
        description="how the model's layers spread over the visible GPUs: auto (fill each "
        "in turn) or GB of weights per GPU, e.g. 20,20",
    )
    tensor_parallel: bool = Field(
        False,
        description="split every layer over the visible GPUs (exllamav2's tensor "
        "parallelism; EXL2 weights only) instead of giving each GPU whole layers",
    )

    @model_validator(mode="after")
    def _one_drafter(self) -> ExLlamaV2Settings:
        if self.draft_model is not None and self.ngram_draft:
            raise ValueError("draft_model and ngram_draft: choose one way to draft tokens")
        return self

    @property
    def drafting(self) -> bool:
        return self.draft_model is not None or self.ngram_draft

    @property
    def gpu_split_gb(self) -> list[float] | None:
        """GB per GPU, or None for auto."""
        if self.gpu_split == "auto":
            return None
        return [float(part) for part in self.gpu_split.split(",")]

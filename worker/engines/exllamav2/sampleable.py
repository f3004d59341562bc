"""Which jobs a decode step may sample on the GPU, which of those may also be fed to the
next step before the host has read their token (overlap.py), and the GPU sampler's
settings for a step of them (row_settings). Plain attribute reads of exllamav2 0.3.2's job
and sampler settings; no exllamav2 import."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from exlq.worker.kernels.sampling import RowSettings


def gpu_sampleable(job: Any) -> bool:
    """True when this step of `job` needs nothing but temperature, top_k and min_p."""
    s = job.gen_settings
    blocked = (job.checkpoint and job.checkpoint["offset"] == 0) or (
        job.new_tokens < job.min_new_tokens
    )
    return (
        job.new_tokens >= 0  # token healing samples from a prefix-restricted set
        and not blocked
        and not job.filters
        and len(job.sequences) == 1  # CFG runs two
        and not job.return_logits
        and s.cfg_scale is None
        and s.token_repetition_penalty == 1.0
        and s.token_frequency_penalty == 0.0
        and s.token_presence_penalty == 0.0
        and s.token_bias is None
        and s.dry_multiplier == 0.0
        and s.xtc_probability == 0.0
        and not s.mirostat
        and not s.post_sampling_hooks
        and not s.temperature_last
        and s.smoothing_factor == 0.0
        and s.skew == 0.0
        and not s.max_temp > s.min_temp
        and s.top_a == 0.0
        and not 0.0 < s.top_p < 1.0
        and not 0.0 < s.tfs < 1.0
        and not 0.0 < s.typical < 1.0
    )


def overlappable(job: Any) -> bool:
    """True when `job`'s sampled token can go straight from the GPU into its next step:
    sampled on the GPU, and accepted by the host as sampled. A grammar (the next mask
    depends on the token), banned strings (a match takes tokens back), logprobs (read from
    the step's logits on the host) and min_new_tokens (the stop tokens' block counts new
    tokens) each need the host's view of a token before the next step."""
    return (
        gpu_sampleable(job)
        and getattr(job, "exlq_constraint", None) is None
        and job.banned_strings_utf32_offsets is None
        and not job.return_top_tokens
        and not job.min_new_tokens
    )


def row_settings(jobs: Sequence[Any]) -> RowSettings:
    """The GPU sampler's settings for a step of `jobs` (gpu_sampleable), one row each, with
    one draw from each job's own generator, as exllamav2 draws once a step: a seeded job
    repeats itself."""
    settings = [job.gen_settings for job in jobs]
    return RowSettings(
        temperature=[s.temperature for s in settings],
        top_k=[s.top_k for s in settings],
        min_p=[s.min_p for s in settings],
        uniform=[job.rng.random() for job in jobs],
    )

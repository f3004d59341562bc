"""What exllamav2's and exllamav3's generators say when a job ends: both end a streaming
result with ``eos`` and name the reason, the prompt's tokens, the new tokens and the tokens
found in the prefix cache alike."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from exlq.protocol.models import FinishReason
from exlq.worker.engines.base import JobEnded


def ended_job(
    job_id: str, result: Mapping[str, Any], prompt_tokens: int, **draft_counts: int
) -> JobEnded:
    """The end of ``job_id`` from the result that ended it; ``prompt_tokens`` where the
    result does not say (``draft_counts``: a drafting generator's counts)."""
    reason: FinishReason = "length" if result.get("eos_reason") == "max_new_tokens" else "stop"
    return JobEnded(
        job_id,
        reason,
        prompt_tokens=int(result.get("prompt_tokens", prompt_tokens)),
        completion_tokens=int(result.get("new_tokens", 0)),
        cached_tokens=int(result.get("cached_tokens", 0)),
        **draft_counts,
    )

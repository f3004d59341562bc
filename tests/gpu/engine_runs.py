"""Jobs run on an engine through its own calls (add, step), as the GPU tests drive it."""

from __future__ import annotations

from typing import Any

from exlq.protocol.models import GenerationRequest
from exlq.worker.engines.base import Engine, JobEnded, TokenChunk


def run(engine: Engine, requests: dict[str, GenerationRequest]) -> dict[str, Any]:
    """Add every request, step until each has ended, and return, by job id: its token ids
    ("ids"), text ("texts"), chunks ("chunks"), logprobs ("logprobs") and end ("ends"). A
    job that errors fails the run; the engine holds no job afterwards."""
    for job_id, request in requests.items():
        engine.add(job_id, request)
    ids: dict[str, list[int]] = {job_id: [] for job_id in requests}
    chunks: dict[str, list[TokenChunk]] = {job_id: [] for job_id in requests}
    logprobs: dict[str, list[Any]] = {job_id: [] for job_id in requests}
    texts = dict.fromkeys(requests, "")
    ends: dict[str, JobEnded] = {}
    while len(ends) < len(requests):
        for out in engine.step():
            if isinstance(out, TokenChunk):
                ids[out.job_id] += out.token_ids
                chunks[out.job_id].append(out)
                logprobs[out.job_id] += out.logprobs or []
                texts[out.job_id] += out.text
            elif isinstance(out, JobEnded):
                ends[out.job_id] = out
            else:
                raise AssertionError(f"{out}")
    assert engine.active_jobs == 0
    return {"ids": ids, "texts": texts, "chunks": chunks, "logprobs": logprobs, "ends": ends}

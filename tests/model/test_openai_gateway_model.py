"""Logprobs through the OpenAI gateway from a real model: SmolLM2-135M-Instruct on the
transformers engine, asked through the `openai` client."""

from __future__ import annotations

from typing import Any

import pytest
from openai import AsyncOpenAI

from exlq.worker.engines.base import Engine
from tests.gateway_server import start_gateway
from tests.model.jobs import CAPITAL

pytestmark = [pytest.mark.model, pytest.mark.integration]
__all__ = ["start_gateway"]


async def test_a_greedy_chat_with_logprobs_lists_its_tokens(
    engine: Engine, start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    await start_worker(engine=engine)
    server = start_gateway()
    async with AsyncOpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=60
    ) as client:
        answer = await client.chat.completions.create(
            model=queue_name,
            messages=[m.model_dump() for m in CAPITAL],
            temperature=0,
            max_tokens=16,
            logprobs=True,
            top_logprobs=2,
        )
    [choice] = answer.choices
    text = choice.message.content
    assert text is not None and "Paris" in text
    assert choice.logprobs is not None and choice.logprobs.content
    content = choice.logprobs.content
    assert "".join(entry.token for entry in content) == text
    assert answer.usage is not None and len(content) == answer.usage.completion_tokens - (
        choice.finish_reason == "stop"  # the end-of-text token is no part of the text
    )
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert all(alt.logprob <= 0 for alt in entry.top_logprobs)
        # Greedy: the chosen token is the likeliest.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.bytes == list(entry.token.encode())

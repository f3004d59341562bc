"""Logprobs and structured output through the OpenAI gateway from a real model:
SmolLM2-135M-Instruct on the transformers engine, asked through the `openai` client."""

from __future__ import annotations

from typing import Annotated, Any, Literal

import pytest
from openai import AsyncOpenAI
from pydantic import BaseModel, Field

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


class Person(BaseModel):
    name: Annotated[str, Field(min_length=1, max_length=16)]
    age: Annotated[int, Field(ge=0, le=120)]
    color: Literal["red", "green", "blue"]
    hobbies: Annotated[list[Annotated[str, Field(max_length=12)]], Field(max_length=3)]


async def test_the_openai_clients_parse_gets_an_instance_of_its_model(
    engine: Engine, start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    """client.chat.completions.parse(response_format=<a pydantic model>) sends the model's
    strict JSON Schema as response_format json_schema, and parses the answer into it."""
    await start_worker(engine=engine)
    server = start_gateway()
    async with AsyncOpenAI(
        base_url=server.base_url, api_key="unused", max_retries=0, timeout=60
    ) as client:
        answer = await client.chat.completions.parse(
            model=queue_name,
            messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=Person,
            temperature=0.9,
            seed=5,
            n=2,
            max_tokens=160,
        )
    assert len(answer.choices) == 2
    for choice in answer.choices:
        assert choice.finish_reason == "stop"
        assert isinstance(choice.message.parsed, Person)

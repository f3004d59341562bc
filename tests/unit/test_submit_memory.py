"""A submit waits for Redis holding only its job's id and JSON: the request it built (a
prompt's ids are a list of hundreds) is freed first, so a burst of submits does not fill
the young generation of its process's collector."""

from __future__ import annotations

import gc
import weakref
from collections.abc import AsyncIterator
from typing import Any

import fakeredis
import pytest

from exlq.producer import AsyncProducer, client
from exlq.producer.submit_batch import SubmitBatcher, Submitted
from exlq.protocol.models import GenerationRequest


@pytest.fixture
async def producer() -> AsyncIterator[AsyncProducer]:
    redis = fakeredis.FakeAsyncRedis()
    async with AsyncProducer(queue="unit", client=redis) as made:
        yield made
    await redis.aclose()


async def test_the_request_a_submit_built_is_freed_before_it_waits_for_redis(
    producer: AsyncProducer, monkeypatch: pytest.MonkeyPatch
) -> None:
    built: list[weakref.ref[GenerationRequest]] = []
    alive_at_wait: list[bool] = []

    build = client.build_request

    def recording_build(prompt: str | None, fields: dict[str, Any]) -> GenerationRequest:
        request = build(prompt, fields)
        built.append(weakref.ref(request))
        return request

    batcher_submit = SubmitBatcher.submit

    async def checking_submit(self: SubmitBatcher, job_id: str, request_json: str) -> Submitted:
        alive_at_wait.append(built[-1]() is not None)
        return await batcher_submit(self, job_id, request_json)

    monkeypatch.setattr(client, "build_request", recording_build)
    monkeypatch.setattr(SubmitBatcher, "submit", checking_submit)
    was_enabled = gc.isenabled()
    gc.disable()  # freed by its count of references, not by a collection
    try:
        handle = await producer.submit(input_ids=list(range(1000, 1256)), max_new_tokens=4)
    finally:
        if was_enabled:
            gc.enable()
    assert alive_at_wait == [False]
    stored = await producer._redis.xrange(producer.keys.jobs)
    assert GenerationRequest.model_validate_json(stored[0][1][b"job"]).id == handle.id


async def test_a_request_passed_in_is_sent_as_it_is(producer: AsyncProducer) -> None:
    request = GenerationRequest(id="given", prompt="hello", max_new_tokens=3)
    handle = await producer.submit(request=request)
    assert handle.id == "given"
    stored = await producer._redis.xrange(producer.keys.jobs)
    assert GenerationRequest.model_validate_json(stored[0][1][b"job"]) == request
    with pytest.raises(TypeError, match="either request= or prompt"):
        await producer.submit("also a prompt", request=request)

"""What goes wrong, as the `openai` client sees it: each failure its status and exception
type, errors inside a stream, API keys; and a client that goes away cancels its job and
frees the worker's slot."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from typing import Any

import httpx2
import openai
import pytest
import redis.asyncio as aioredis
from openai import AsyncOpenAI

from exlq import AsyncProducer
from exlq.protocol.keys import QueueKeys
from tests.gateway_server import GatewayServer, start_gateway

pytestmark = pytest.mark.integration
__all__ = ["start_gateway"]

HELLO = [{"role": "user", "content": "hello there"}]


def async_client(server: GatewayServer, key: str = "unused") -> AsyncOpenAI:
    return AsyncOpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)


async def _heartbeat(client: aioredis.Redis, queue: str, age_s: float) -> None:
    info = {"engine": "echo", "capacity": 1, "load": 0, "last_seen": time.time() - age_s}
    await client.hset(QueueKeys(queue).workers, "elsewhere:1", json.dumps(info))


async def test_an_unknown_model_is_not_found(start_gateway: Any) -> None:
    server = start_gateway()
    async with async_client(server) as client:
        with pytest.raises(openai.NotFoundError) as raised:
            await client.chat.completions.create(model="no-such-model", messages=HELLO)
    assert raised.value.code == "model_not_found"
    assert "no-such-model" in raised.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 5}, "temperature"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "x", "tool_call_id": "1"}]}, "messages[0].role"),
        ({"extra_body": {"best_guess": True}}, "best_guess"),
        ({"response_format": {"type": "json_objet"}}, "response_format"),
        ({"extra_body": {"regex": ""}}, "regex"),
        ({"top_logprobs": 2}, "top_logprobs"),
    ],
)
async def test_a_bad_parameter_is_a_bad_request_naming_it(
    start_worker: Any, start_gateway: Any, queue_name: str, fields: dict[str, Any], param: str
) -> None:
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        with pytest.raises(openai.BadRequestError) as raised:
            await client.chat.completions.create(
                **{"model": queue_name, "messages": HELLO, **fields}
            )
    assert raised.value.param == param
    assert param.split("[")[0] in raised.value.message


async def test_a_body_that_is_no_json_is_a_bad_request(start_gateway: Any) -> None:
    server = start_gateway()
    async with httpx2.AsyncClient() as http:
        response = await http.post(f"{server.base_url}/completions", content=b"{not json")
    assert response.status_code == 400
    assert response.json()["error"]["type"] == "invalid_request_error"


async def test_a_request_the_worker_refuses_is_a_bad_request_whole_or_streamed(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    """Past the worker's max_new_tokens (8192 by default): its error event invalid_request
    is a 400; inside a stream, an error event that the client raises."""
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        with pytest.raises(openai.BadRequestError, match="max_new_tokens"):
            await client.completions.create(model=queue_name, prompt="x", max_tokens=9000)
        stream = await client.completions.create(
            model=queue_name, prompt="x", max_tokens=9000, stream=True
        )
        with pytest.raises(openai.APIError, match="max_new_tokens"):
            async for _ in stream:
                pass


async def test_structured_output_from_an_engine_that_cannot_constrain_is_a_bad_request(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    """The gateway passes response_format on; the echo worker refuses it (invalid_request),
    which the client reads as a 400 saying which engines constrain output."""
    await start_worker()
    server = start_gateway()
    async with async_client(server) as client:
        with pytest.raises(openai.BadRequestError, match="does not constrain output"):
            await client.chat.completions.create(
                model=queue_name, messages=HELLO, response_format={"type": "json_object"}
            )


async def test_a_full_queue_is_rate_limited(
    start_gateway: Any, queue_name: str, redis_url: str, redis_client: aioredis.Redis
) -> None:
    """A live worker (its heartbeat) that takes nothing: one job fills a backlog of one."""
    await _heartbeat(redis_client, queue_name, age_s=0)
    server = start_gateway(max_backlog=1)
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        await producer.submit("waiting", max_new_tokens=1)
        async with async_client(server) as client:
            with pytest.raises(openai.RateLimitError) as raised:
                await client.completions.create(model=queue_name, prompt="x")
    assert raised.value.code == "queue_full"


async def test_requests_past_the_in_flight_bound_are_refused_at_once(
    start_worker: Any, start_gateway: Any, queue_name: str
) -> None:
    """Two streams open on a gateway bound to two requests: a third is answered 503
    gateway_overloaded with a Retry-After, health probes still answer, and once a stream
    ends the next request is served."""
    await start_worker(echo_tokens_per_second=20.0)
    server = start_gateway(max_in_flight=2)
    async with async_client(server) as client:
        streams = [
            await client.chat.completions.create(
                model=queue_name, messages=HELLO, max_tokens=20, stream=True
            )
            for _ in range(2)
        ]
        for stream in streams:
            await anext(aiter(stream))  # both are being served
        with pytest.raises(openai.InternalServerError) as refused:
            await client.chat.completions.create(model=queue_name, messages=HELLO, max_tokens=1)
        async with httpx2.AsyncClient() as probe:
            ready = await probe.get(server.base_url.removesuffix("/v1") + "/readyz")
        for stream in streams:
            async for _ in stream:
                pass
        served = await client.chat.completions.create(
            model=queue_name, messages=HELLO, max_tokens=1
        )
    assert refused.value.status_code == 503
    assert refused.value.code == "gateway_overloaded"
    assert refused.value.response.headers["retry-after"] == "1"
    assert ready.status_code == 200
    assert served.choices[0].finish_reason == "length"


async def test_a_model_whose_workers_are_gone_is_unavailable(
    start_worker: Any, start_gateway: Any, queue_name: str, redis_client: aioredis.Redis
) -> None:
    """A queue whose workers all stopped (its stream stays), and one whose only heartbeat
    is stale: 503, which the client raises as InternalServerError."""
    running = await start_worker()
    assert await running.shutdown() == 0
    server = start_gateway()
    async with async_client(server) as client:
        with pytest.raises(openai.InternalServerError) as stopped:
            await client.chat.completions.create(model=queue_name, messages=HELLO)
        await _heartbeat(redis_client, "stale-queue", age_s=60)
        with pytest.raises(openai.InternalServerError) as stale:
            await client.chat.completions.create(model="stale-queue", messages=HELLO)
    for raised in (stopped, stale):
        assert raised.value.status_code == 503
        assert raised.value.code == "no_live_worker"


async def test_api_keys_are_asked_for_on_every_v1_route(
    start_worker: Any, start_gateway: Any, queue_name: str, tmp_path: Any
) -> None:
    await start_worker()
    keys_file = tmp_path / "keys"
    keys_file.write_text("# the team's key\nfile-key\n")
    server = start_gateway(api_keys_file=keys_file, api_keys="env-key")
    async with httpx2.AsyncClient() as http:
        bare = await http.get(f"{server.base_url}/models")
    assert bare.status_code == 401
    assert bare.json()["error"]["code"] == "invalid_api_key"
    for key in ("file-key", "env-key"):
        async with async_client(server, key) as client:
            answer = await client.completions.create(model=queue_name, prompt="ok", max_tokens=1)
            assert answer.choices[0].text == " ok"
    async with async_client(server, "wrong") as client:
        with pytest.raises(openai.AuthenticationError):
            await client.models.list()
        with pytest.raises(openai.AuthenticationError):
            await client.chat.completions.create(model=queue_name, messages=HELLO)


async def _job_state(client: aioredis.Redis, queue: str, job_id: str) -> str | None:
    state = await client.hget(QueueKeys(queue).job(job_id), "state")
    return None if state is None else state.decode()


async def _wait_for_state(
    client: aioredis.Redis, queue: str, job_id: str, state: str, timeout_s: float = 10.0
) -> None:
    async with asyncio.timeout(timeout_s):
        while await _job_state(client, queue, job_id) != state:
            await asyncio.sleep(0.02)


async def _the_next_job_runs(server: GatewayServer, queue: str) -> None:
    """With one slot, this job runs only once the slot is free."""
    async with async_client(server) as client:
        answer = await client.completions.create(model=queue, prompt="next", max_tokens=2)
    assert answer.choices[0].text == " next next"


async def test_a_stream_closed_early_cancels_its_job_and_frees_the_slot(
    start_worker: Any, start_gateway: Any, queue_name: str, redis_client: aioredis.Redis
) -> None:
    await start_worker(max_batch_size=1, echo_tokens_per_second=20.0)
    server = start_gateway()
    body = {"model": queue_name, "prompt": "long", "max_tokens": 2000, "stream": True}
    url = f"{server.base_url}/completions"
    async with (
        httpx2.AsyncClient(timeout=30) as http,
        http.stream("POST", url, json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                response_id = json.loads(line.removeprefix("data: "))["id"]
                break
    job_id = f"{response_id}-0"
    await _wait_for_state(redis_client, queue_name, job_id, "cancelled")
    await _the_next_job_runs(server, queue_name)


async def test_a_client_that_leaves_a_whole_answer_cancels_its_job(
    start_worker: Any, start_gateway: Any, queue_name: str, redis_client: aioredis.Redis
) -> None:
    await start_worker(max_batch_size=1, echo_tokens_per_second=20.0)
    server = start_gateway()
    body = {"model": queue_name, "messages": HELLO, "max_tokens": 2000}
    async with httpx2.AsyncClient(timeout=30) as http:
        asking = asyncio.ensure_future(http.post(f"{server.base_url}/chat/completions", json=body))
        pattern = QueueKeys(queue_name).job("*")
        job_key = None
        async with asyncio.timeout(10):
            while job_key is None:
                job_key = next(iter([k async for k in redis_client.scan_iter(match=pattern)]), None)
                await asyncio.sleep(0.02)
        job_id = job_key.decode().rsplit(":", 1)[1]
        await _wait_for_state(redis_client, queue_name, job_id, "running")
        asking.cancel()  # the connection closes with the request
        with pytest.raises(asyncio.CancelledError):
            await asking
    await _wait_for_state(redis_client, queue_name, job_id, "cancelled")
    await _the_next_job_runs(server, queue_name)


async def test_without_redis_the_gateway_is_alive_but_not_ready(start_gateway: Any) -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    server = start_gateway(redis_url=f"redis://127.0.0.1:{closed_port}/0")
    root = server.base_url.removesuffix("/v1")
    async with httpx2.AsyncClient(timeout=30) as http:
        health = await http.get(f"{root}/healthz")
        ready = await http.get(f"{root}/readyz")
    assert health.status_code == 200
    assert ready.status_code == 503
    async with async_client(server) as client:
        with pytest.raises(openai.InternalServerError) as raised:
            await client.completions.create(model="any", prompt="x")
    assert raised.value.status_code == 503 and raised.value.code == "redis_unavailable"

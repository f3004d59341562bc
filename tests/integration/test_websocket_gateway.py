"""exlq gateway websocket, through a real websockets client, a real Redis and an echo
worker: every exllamav2 action with its server's message shapes, streaming, concurrent
infers, stop and disconnect, the tokenizer actions, and bad input."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, cast

import pytest
import redis.asyncio as aioredis
from websockets.asyncio.client import ClientConnection, connect

from exlq.producer import client as sdk_client
from exlq.producer.gateways.exllamav2_ws.server import (
    WebSocketSettings,
    bound_port,
    running_gateway,
)
from exlq.protocol.keys import QueueKeys
from tests.ws_tokenizer import make_tokenizer_folder, reference_decode, reference_ids

pytestmark = pytest.mark.integration

Message = dict[str, Any]
GatewayFactory = Callable[..., "asyncio.Future[str]"]

# The keys of each message as exllamav2 0.3.2's server sends them, for a request that
# carries request_id and response_id (and, for infer, tag).
IDS = {"action", "request_id", "response_id"}
CHUNK_KEYS = IDS | {"tag", "util_text", "response_type", "chunk"}
FULL_KEYS = IDS | {"tag", "util_text", "chunk", "stop_reason", "response_type", "response"}
ERROR_KEYS = {"response_type", "error", "error_code"}

PROMPT = "alpha beta gamma delta"


@pytest.fixture
async def gateway(redis_url: str, queue_name: str) -> AsyncIterator[Callable[..., Any]]:
    """Start the gateway in this event loop on a free port; returns its ws:// URL."""
    async with contextlib.AsyncExitStack() as stack:

        async def start(**overrides: Any) -> str:
            options: dict[str, Any] = {
                "queue": queue_name,
                "redis_url": redis_url,
                "port": 0,
                "drain_grace_s": 10.0,
            }
            options.update(overrides)
            server = await stack.enter_async_context(running_gateway(WebSocketSettings(**options)))
            return f"ws://127.0.0.1:{bound_port(server)}"

        yield start


async def send(ws: ClientConnection, message: Message | str) -> None:
    await ws.send(message if isinstance(message, str) else json.dumps(message))


async def receive(ws: ClientConnection) -> Message:
    async with asyncio.timeout(10):
        message: Message = json.loads(await ws.recv())
    return message


async def ask(ws: ClientConnection, message: Message | str) -> Message:
    await send(ws, message)
    return await receive(ws)


async def until_full(ws: ClientConnection, count: int = 1) -> list[Message]:
    """Every message up to and including the count-th full (or error) message."""
    seen: list[Message] = []
    ends = 0
    while ends < count:
        seen.append(await receive(ws))
        ends += seen[-1].get("response_type") in ("full", "error")
    return seen


async def only_job(redis_client: aioredis.Redis, queue_name: str) -> Message:
    """The request of the one job the queue's stream holds."""
    entries = cast(
        "list[tuple[bytes, dict[bytes, bytes]]]",
        await redis_client.xrange(QueueKeys(queue_name).jobs),
    )
    ((_, fields),) = entries
    job: Message = json.loads(fields[b"job"])
    return job


def infer(request_id: str, **extra: Any) -> Message:
    return {
        "action": "infer",
        "request_id": request_id,
        "response_id": f"resp-{request_id}",
        "tag": {"client": "test"},
        "text": PROMPT,
        "max_new_tokens": 6,
        "stream": True,
        **extra,
    }


async def test_echo_answers_with_the_ids_it_was_given(gateway: Callable[..., Any]) -> None:
    async with connect(await gateway()) as ws:
        reply = await ask(ws, {"action": "echo", "request_id": "e1", "response_id": 9})
        assert reply == {"action": "echo", "request_id": "e1", "response_id": 9}
        assert await ask(ws, {"action": "echo"}) == {"action": "echo"}


@pytest.mark.cluster_too
async def test_infer_streams_chunks_then_the_full_response(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker()
    async with connect(await gateway()) as ws:
        await send(ws, infer("r1"))
        messages = await until_full(ws)
    *chunks, full = messages
    assert chunks
    for chunk in chunks:
        assert set(chunk) == CHUNK_KEYS
        assert chunk["response_type"] == "chunk" and chunk["chunk"]
        assert (chunk["request_id"], chunk["response_id"]) == ("r1", "resp-r1")
        assert chunk["tag"] == {"client": "test"} and chunk["util_text"] == PROMPT
    assert set(full) == FULL_KEYS
    expected = " alpha beta gamma delta alpha beta"
    assert full["response"] == expected == "".join(c["chunk"] for c in chunks)
    assert (full["response_type"], full["chunk"], full["stop_reason"]) == ("full", "", "num_tokens")
    assert full["util_text"] == PROMPT and full["action"] == "infer"


async def test_stream_full_sends_the_response_so_far(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker()
    async with connect(await gateway()) as ws:
        await send(ws, infer("r1", stream_full=True))
        *chunks, full = await until_full(ws)
    so_far = ""
    for chunk in chunks:
        assert set(chunk) == CHUNK_KEYS | {"response"}
        so_far += chunk["chunk"]
        assert chunk["response"] == so_far
    assert full["response"] == so_far


async def test_without_stream_only_the_full_message_comes(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker()
    async with connect(await gateway()) as ws:
        await send(ws, {"action": "infer", "text": "one two", "max_new_tokens": 3, "stream": False})
        (full,) = await until_full(ws)
    assert set(full) == {"action", "util_text", "chunk", "stop_reason", "response_type", "response"}
    assert full["response"] == " one two one"


async def test_a_stop_string_ends_with_eos(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker()
    async with connect(await gateway()) as ws:
        await send(ws, infer("r1", stop_conditions=["gamma", 50256], max_new_tokens=20))
        *_, full = await until_full(ws)
    assert full["stop_reason"] == "eos"
    assert full["response"] == " alpha beta "


async def test_sampling_settings_reach_the_job(
    gateway: Callable[..., Any],
    start_worker: Callable[..., Any],
    redis_client: aioredis.Redis,
    queue_name: str,
) -> None:
    await start_worker()
    async with connect(await gateway()) as ws:
        await send(ws, infer("r1", top_k=0, top_p=0.0, temperature=0.0, rep_pen=1.1))
        await until_full(ws)
    job = await only_job(redis_client, queue_name)
    assert job["prompt"] == PROMPT and job["max_new_tokens"] == 6
    assert job["sampling"]["top_k"] == 0 and job["sampling"]["top_p"] == 1.0
    assert job["sampling"]["temperature"] == 0.0
    assert job["sampling"]["repetition_penalty"] == 1.1


async def test_two_infers_on_one_connection_run_at_once(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker(echo_tokens_per_second=20.0)
    async with connect(await gateway()) as ws:
        await send(ws, infer("a"))
        await send(ws, infer("b"))
        messages = await until_full(ws, count=2)
    first_full = next(i for i, m in enumerate(messages) if m["response_type"] == "full")
    before = messages[:first_full]
    assert {m["request_id"] for m in before if m["response_type"] == "chunk"} == {"a", "b"}
    fulls = {m["request_id"]: m for m in messages if m["response_type"] == "full"}
    assert fulls["a"]["response"] == fulls["b"]["response"] == " alpha beta gamma delta alpha beta"


async def test_stop_interrupts_only_its_own_connection(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker(echo_tokens_per_second=20.0)
    url = await gateway()
    async with connect(url) as stopper, connect(url) as other:
        await send(stopper, infer("long", max_new_tokens=2000))
        await send(other, infer("short", max_new_tokens=12))
        first = await receive(stopper)
        assert first["response_type"] == "chunk"
        await send(stopper, {"action": "stop", "request_id": "s1", "response_id": "rs"})
        answers = await until_full(stopper)
        *_, other_full = await until_full(other)
    stop_reply = next(m for m in answers if m["action"] == "stop")
    assert stop_reply == {"action": "stop", "request_id": "s1", "response_id": "rs"}
    interrupted = answers[-1]
    assert set(interrupted) == FULL_KEYS
    assert interrupted["request_id"] == "long" and interrupted["stop_reason"] == "interrupted"
    assert interrupted["response"].startswith(" alpha")
    assert other_full["stop_reason"] == "num_tokens"
    assert len(other_full["response"].split()) == 12


async def test_stop_with_nothing_running_answers(gateway: Callable[..., Any]) -> None:
    async with connect(await gateway()) as ws:
        assert await ask(ws, {"action": "stop", "request_id": 1}) == {
            "action": "stop",
            "request_id": 1,
        }


async def test_a_closed_connection_cancels_its_jobs(
    gateway: Callable[..., Any],
    start_worker: Callable[..., Any],
    redis_client: aioredis.Redis,
    queue_name: str,
) -> None:
    await start_worker(echo_tokens_per_second=20.0)
    async with connect(await gateway()) as ws:
        await send(ws, infer("long", max_new_tokens=2000))
        assert (await receive(ws))["response_type"] == "chunk"
    keys = QueueKeys(queue_name)
    job_id = (await only_job(redis_client, queue_name))["id"]
    async with asyncio.timeout(10):
        while await redis_client.hget(keys.job(job_id), "state") != b"cancelled":
            await asyncio.sleep(0.02)
    result = json.loads(cast("bytes", await redis_client.get(keys.result(job_id))))
    assert result["finish_reason"] == "cancelled"


async def test_token_actions_use_the_tokenizer(gateway: Callable[..., Any], tmp_path: Path) -> None:
    folder = make_tokenizer_folder(tmp_path / "model")
    text = "The quick brown fox jumps over the lazy dog."
    ids = reference_ids(folder, text)
    async with connect(await gateway(tokenizer_dir=folder)) as ws:
        counted = await ask(
            ws, {"action": "estimate_token", "request_id": "c", "response_id": 1, "text": text}
        )
        assert counted == {
            "action": "estimate_token",
            "request_id": "c",
            "response_id": 1,
            "num_tokens": len(ids),
        }
        request = {"action": "lefttrim_token", "request_id": "t", "text": text}
        trimmed = await ask(ws, {**request, "trimmed_length": 3})
        assert trimmed == {
            "action": "lefttrim_token",
            "request_id": "t",
            "trimmed_text": reference_decode(folder, ids[-3:]),
        }
        assert text.endswith(trimmed["trimmed_text"]) and trimmed["trimmed_text"] != text
        whole = await ask(ws, {**request, "trimmed_length": len(ids)})
        assert whole["trimmed_text"] == text


@pytest.mark.parametrize("action", ["estimate_token", "lefttrim_token"])
async def test_token_actions_without_a_tokenizer_say_to_pass_one(
    gateway: Callable[..., Any], action: str
) -> None:
    async with connect(await gateway()) as ws:
        reply = await ask(
            ws, {"action": action, "request_id": "x", "text": "hi", "trimmed_length": 1}
        )
    assert set(reply) == {"action", "request_id"} | ERROR_KEYS
    assert (reply["action"], reply["request_id"]) == (action, "x")
    assert reply["response_type"] == "error" and reply["error_code"] == "no_tokenizer"
    assert "--tokenizer" in reply["error"]


@pytest.mark.parametrize(
    ("message", "code", "says"),
    [
        ("not json {", "invalid_json", "not JSON"),
        ("[1, 2]", "invalid_json", "JSON object"),
        ('{"action": "echo", "request_id": NaN}', "invalid_json", "NaN is not a JSON value"),
        ({"request_id": "x"}, "invalid_request", "no action"),
        ({"action": "generate", "request_id": "x"}, "unknown_action", "generate"),
        ({"action": ["echo"]}, "unknown_action", "echo"),
        ({"action": "estimate_token"}, "no_tokenizer", "--tokenizer"),
        (
            {"action": "infer", "request_id": "x", "tag": 1, "max_new_tokens": 4, "stream": True},
            "invalid_request",
            "text",
        ),
        ({**infer("x"), "max_new_tokens": "4"}, "invalid_request", "max_new_tokens"),
        ({**infer("x"), "temperature": 99.0}, "invalid_request", "temperature"),
        ({**infer("x"), "max_new_tokens": 0}, "invalid_request", "max_new_tokens"),
        ({**infer("x"), "stop_conditions": [""]}, "invalid_request", "stop"),
        ({**infer("x"), "top_a": 0.3}, "unsupported", "top_a"),
        ({**infer("x"), "bann_bann": [5]}, "unsupported", "bann_bann"),
    ],
)
async def test_bad_input_is_answered_and_the_connection_goes_on(
    gateway: Callable[..., Any], message: Message | str, code: str, says: str
) -> None:
    async with connect(await gateway()) as ws:
        reply = await ask(ws, message)
        assert reply["response_type"] == "error" and reply["error_code"] == code
        assert says in reply["error"]
        if isinstance(message, dict):
            echoed: Message = {
                k: message[k] for k in ("action", "request_id", "response_id") if k in message
            }
            if message.get("action") == "infer" and "tag" in message:
                echoed["tag"] = message["tag"]
            assert set(reply) == set(echoed) | ERROR_KEYS
            assert {k: reply[k] for k in echoed} == echoed
        else:
            assert set(reply) == ERROR_KEYS
        assert await ask(ws, {"action": "echo", "request_id": "after"}) == {
            "action": "echo",
            "request_id": "after",
        }


async def test_a_job_error_is_answered_on_its_infer(
    gateway: Callable[..., Any], start_worker: Callable[..., Any]
) -> None:
    await start_worker()
    async with connect(await gateway()) as ws:
        # Over the worker's max_new_tokens limit (8192 by default): the worker refuses it.
        await send(ws, infer("big", max_new_tokens=9000))
        (reply,) = await until_full(ws)
    assert set(reply) == IDS | {"tag"} | ERROR_KEYS
    assert reply["request_id"] == "big" and reply["error_code"] == "invalid_request"
    assert "max_new_tokens" in reply["error"]


async def test_no_worker_is_answered(
    gateway: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk_client, "WORKER_CHECK_S", 0.1)
    async with connect(await gateway()) as ws:
        await send(ws, infer("lonely"))
        (reply,) = await until_full(ws)
    assert reply["request_id"] == "lonely" and reply["error_code"] == "no_workers"
    assert "no live worker" in reply["error"]


async def test_a_full_queue_is_answered(
    gateway: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(sdk_client, "WORKER_CHECK_S", 0.5)
    async with connect(await gateway(max_backlog=1)) as ws:
        await send(ws, infer("first"))
        await send(ws, infer("second"))
        replies = {m["request_id"]: m for m in await until_full(ws, count=2)}
    assert replies["second"]["error_code"] == "queue_full"
    assert replies["first"]["error_code"] == "no_workers"

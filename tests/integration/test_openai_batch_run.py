"""A batch from upload to output file through OpenAI's client, on an echo worker: chat and
completions, per-request failures, a file with bad lines, and the create-time refusals."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from tests.integration.test_openai_batch_app import (
    chat_line,
    deploy_bulk_limit,
    echo,
    file_lines,
    jsonl,
    serve_gateway,
    upload,
    wait_for_status,
)

pytestmark = [pytest.mark.integration, pytest.mark.usefixtures("deploy_bulk_limit")]
__all__ = ["deploy_bulk_limit"]


def _by_custom_id(lines: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    found = {line["custom_id"]: line for line in lines}
    assert len(found) == len(lines), "a custom_id came back twice"
    return found


@pytest.mark.cluster_too
async def test_a_chat_batch_completes_with_every_request_answered(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    requests = [
        chat_line(f"req-{i}", queue_name, f"word{i} other{i}", 3 + i % 4) for i in range(10)
    ]
    requests.append(chat_line("two-choices", queue_name, "one two three", 4, n=2, seed=7))
    async with serve_gateway(redis_url) as gateway:
        client = gateway.client
        file_id = await upload(client, jsonl(requests))
        created = await client.batches.create(
            input_file_id=file_id,
            endpoint="/v1/chat/completions",
            completion_window="24h",
            metadata={"job": "nightly"},
        )
        assert created.status == "validating" and created.metadata == {"job": "nightly"}
        assert created.id.startswith("batch_") and created.input_file_id == file_id
        batch = await wait_for_status(client, created.id, {"completed", "failed"})
        assert batch.status == "completed", batch.errors
        assert batch.request_counts is not None
        assert (batch.request_counts.total, batch.request_counts.completed) == (11, 11)
        assert batch.request_counts.failed == 0 and batch.error_file_id is None
        assert batch.completed_at and batch.in_progress_at and batch.finalizing_at
        output_file = await client.files.retrieve(batch.output_file_id or "")
        assert output_file.purpose == "batch_output"
        output = _by_custom_id(await file_lines(client, batch.output_file_id))
    assert set(output) == {r["custom_id"] for r in requests}
    for request in requests:
        line = output[request["custom_id"]]
        assert line["id"].startswith("batch_req_") and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200
        body = response["body"]
        assert body["object"] == "chat.completion" and body["model"] == queue_name
        words = request["body"]["messages"][0]["content"]
        expected = echo(words, request["body"]["max_tokens"])
        choices = body["choices"]
        assert len(choices) == request["body"].get("n", 1)
        assert all(c["message"]["content"] == expected for c in choices)
        assert body["usage"]["completion_tokens"] == len(choices) * request["body"]["max_tokens"]


async def test_a_completions_batch_answers_good_requests_and_reports_bad_ones(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()

    def line(custom_id: str, **body: Any) -> dict[str, Any]:
        return {
            "custom_id": custom_id,
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": queue_name, **body},
        }

    requests = [
        line("good-1", prompt="alpha beta", max_tokens=3),
        line("bad-param", prompt="alpha", max_tokens=2, frobnicate=True),
        line("logprobs", prompt="alpha", max_tokens=2, logprobs=1),
        line("good-2", prompt="gamma", max_tokens=2),
        line("bad-model", prompt="gamma", max_tokens=2, model="no{such}model"),
    ]
    async with serve_gateway(redis_url) as gateway:
        client = gateway.client
        file_id = await upload(client, jsonl(requests))
        created = await client.batches.create(
            input_file_id=file_id, endpoint="/v1/completions", completion_window="24h"
        )
        batch = await wait_for_status(client, created.id, {"completed", "failed"})
        assert batch.status == "completed"
        assert batch.request_counts is not None
        counts = batch.request_counts
        assert (counts.total, counts.completed, counts.failed) == (5, 2, 3)
        output = _by_custom_id(await file_lines(client, batch.output_file_id))
        errors = _by_custom_id(await file_lines(client, batch.error_file_id))
    assert set(output) == {"good-1", "good-2"}
    assert output["good-1"]["response"]["body"]["choices"][0]["text"] == " alpha beta alpha"
    assert output["good-2"]["response"]["body"]["object"] == "text_completion"
    assert set(errors) == {"bad-param", "logprobs", "bad-model"}
    for custom_id, param in (("bad-param", "frobnicate"), ("logprobs", "logprobs")):
        response = errors[custom_id]["response"]
        assert response["status_code"] == 400
        assert response["body"]["error"]["param"] == param
        assert errors[custom_id]["error"] is None
    assert errors["bad-model"]["response"]["body"]["error"]["param"] == "model"


async def test_a_file_with_bad_lines_fails_the_batch_naming_each_line(redis_url: str) -> None:
    good = chat_line("a", "m", "hello", 2)
    content = b"\n".join(
        [
            jsonl([good]).strip(),
            b"{not json",
            jsonl([{**good, "custom_id": "a"}]).strip(),  # a duplicate custom_id
            jsonl([{**good, "custom_id": "b", "url": "/v1/completions"}]).strip(),
            jsonl([{**good, "custom_id": "c", "method": "GET"}]).strip(),
            b"",
            jsonl([{"custom_id": "d", "method": "POST", "url": "/v1/chat/completions"}]).strip(),
        ]
    )
    async with serve_gateway(redis_url) as gateway:
        client = gateway.client
        file_id = await upload(client, content)
        created = await client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = await wait_for_status(client, created.id, {"failed", "in_progress", "completed"})
    assert batch.status == "failed" and batch.failed_at
    assert batch.errors is not None and batch.errors.data is not None
    found = [(e.line, e.code, e.param) for e in batch.errors.data]
    assert found == [
        (2, "invalid_json_line", None),
        (3, "duplicate_custom_id", "custom_id"),
        (4, "mismatched_url", "url"),
        (5, "invalid_method", "method"),
        (7, "missing_required_parameter", "body"),
    ]
    assert batch.output_file_id is None


async def test_create_refuses_what_it_cannot_run_and_lists_newest_first(redis_url: str) -> None:
    async with serve_gateway(redis_url) as gateway:
        client = gateway.client
        file_id = await upload(client, jsonl([chat_line("a", "m", "hello", 2)]))
        with pytest.raises(openai.BadRequestError, match="completion_window"):
            await client.batches.create(
                input_file_id=file_id,
                endpoint="/v1/chat/completions",
                completion_window="48h",  # type: ignore[arg-type]
            )
        with pytest.raises(openai.BadRequestError, match="endpoint"):
            await client.batches.create(
                input_file_id=file_id, endpoint="/v1/embeddings", completion_window="24h"
            )
        with pytest.raises(openai.NotFoundError):
            await client.batches.create(
                input_file_id="file-missing",
                endpoint="/v1/chat/completions",
                completion_window="24h",
            )
        with pytest.raises(openai.NotFoundError):
            await client.batches.retrieve("batch_missing")
        made = [
            (
                await client.batches.create(
                    input_file_id=file_id,
                    endpoint="/v1/chat/completions",
                    completion_window="24h",
                )
            ).id
            for _ in range(3)
        ]
        assert [b.id async for b in client.batches.list()] == made[::-1]
        page = await client.batches.list(limit=2)
        assert [b.id for b in page.data] == [made[2], made[1]] and page.has_more
        rest = await client.batches.list(after=made[1], limit=2)
        assert [b.id for b in rest.data] == [made[0]] and not rest.has_more


async def test_a_batch_larger_than_the_in_flight_bound_completes_in_steps(
    redis_url: str, queue_name: str, start_worker: Any
) -> None:
    await start_worker()
    requests = [chat_line(f"r{i}", queue_name, f"v{i}", 2) for i in range(9)]
    requests.append(chat_line("wide", queue_name, "w", 2, n=4))  # more jobs than the bound
    async with serve_gateway(redis_url, max_in_flight_jobs=3) as gateway:
        file_id = await upload(gateway.client, jsonl(requests))
        created = await gateway.client.batches.create(
            input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
        )
        batch = await wait_for_status(gateway.client, created.id, {"completed", "failed"})
        output = _by_custom_id(await file_lines(gateway.client, batch.output_file_id))
    assert set(output) == {r["custom_id"] for r in requests}
    assert len(output["wide"]["response"]["body"]["choices"]) == 4

"""/v1/files through OpenAI's client: upload, list, retrieve, download, delete, and the
limits, on a Redis that refuses values over 2 MB as the shipped one does."""

from __future__ import annotations

import io

import openai
import pytest

from tests.integration.test_openai_batch_app import (
    deploy_bulk_limit,
    jsonl,
    serve_gateway,
    upload,
)

pytestmark = pytest.mark.integration
__all__ = ["deploy_bulk_limit"]


@pytest.mark.usefixtures("deploy_bulk_limit")
async def test_a_file_larger_than_redis_takes_in_one_value_comes_back_byte_for_byte(
    redis_url: str,
) -> None:
    # 3 MB of lines, more than one Redis value may hold here.
    content = jsonl([{"custom_id": f"r{i}", "pad": "x" * 3000} for i in range(1000)])
    assert len(content) > 2 * 1024 * 1024
    async with serve_gateway(redis_url) as gateway:
        client = gateway.client
        file_id = await upload(client, content, "requests.jsonl")
        found = await client.files.retrieve(file_id)
        assert (found.id, found.object, found.bytes) == (file_id, "file", len(content))
        assert (found.filename, found.purpose, found.status) == (
            "requests.jsonl",
            "batch",
            "processed",
        )
        assert (await client.files.content(file_id)).read() == content


async def test_files_are_listed_newest_first_by_purpose_and_deleted(redis_url: str) -> None:
    async with serve_gateway(redis_url) as gateway:
        client = gateway.client
        first = await upload(client, b'{"a": 1}\n')
        second = await upload(client, b'{"b": 2}\n')
        listed = [f.id async for f in client.files.list()]
        assert listed == [second, first]
        assert [f.id async for f in client.files.list(purpose="batch", order="asc")] == [
            first,
            second,
        ]
        assert [f.id async for f in client.files.list(purpose="batch_output")] == []
        page = await client.files.list(limit=1)
        assert [f.id for f in page.data] == [second] and page.has_more
        deleted = await client.files.delete(first)
        assert deleted.deleted and deleted.id == first
        with pytest.raises(openai.NotFoundError):
            await client.files.retrieve(first)
        with pytest.raises(openai.NotFoundError):
            await client.files.content(first)
        with pytest.raises(openai.NotFoundError):
            await client.files.delete(first)


async def test_uploads_outside_the_limits_are_refused(redis_url: str) -> None:
    async with serve_gateway(redis_url, max_file_bytes=100_000, max_requests=3) as gateway:
        client = gateway.client
        with pytest.raises(openai.BadRequestError, match="purpose"):
            await client.files.create(file=("a.jsonl", io.BytesIO(b"{}\n")), purpose="fine-tune")
        with pytest.raises(openai.APIStatusError, match="100000 bytes") as too_large:
            await upload(client, b"x" * 200_000)
        assert too_large.value.status_code == 413
        with pytest.raises(openai.BadRequestError, match="more than 3 requests"):
            await upload(client, b"{}\n{}\n\n{}\n{}\n")
        with pytest.raises(openai.BadRequestError, match="empty"):
            await upload(client, b"")
        # Three requests and blank lines are within the limits.
        assert await upload(client, b"{}\n\n{}\r\n{}")
        assert [f async for f in client.files.list()] != []

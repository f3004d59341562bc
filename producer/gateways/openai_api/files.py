"""/v1/files: upload a batch's requests (JSONL, purpose "batch"), list, retrieve, download
and delete files; a batch's output and error files are files of purpose "batch_output"."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException

from exlq.producer.gateways.openai_api.batch_settings import (
    FILE_CHUNK_BYTES,
    BatchSettings,
    batch_settings_of,
)
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.file_store import FileStore, FileWriter

router = APIRouter()
# What a multipart body adds around the file itself (boundaries, part headers, purpose).
_MULTIPART_SLACK_BYTES = 64 * 1024


def file_store(request: Request) -> FileStore:
    pool = request.app.state.pool
    return FileStore(pool.batch_redis, pool.batch_prefix)


def not_found(file_id: str) -> OpenAIError:
    return OpenAIError(404, f"No such File object: {file_id}", param="file_id")


@router.post("/v1/files")
async def upload_file(request: Request) -> dict[str, Any]:
    settings = batch_settings_of(request.app.state)
    _refuse_oversize_body(request.headers.get("content-length"), settings.max_file_bytes)
    try:
        async with request.form(max_files=1, max_fields=4) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if not isinstance(upload, UploadFile):
                raise OpenAIError(400, "file: a file part is required", param="file")
            if purpose != "batch":
                raise OpenAIError(
                    400,
                    f"purpose: {purpose!r} is not supported by this server; upload files "
                    "for the Batch API with purpose 'batch'",
                    param="purpose",
                )
            writer = file_store(request).writer()
            try:
                await _copy_batch_file(upload, writer, settings)
                return await writer.finish(upload.filename or "upload.jsonl", "batch")
            except BaseException:
                await writer.abort()
                raise
    except HTTPException as exc:  # the multipart parser's refusal
        raise OpenAIError(
            exc.status_code, f"the upload is not valid multipart: {exc.detail}"
        ) from None


def _refuse_oversize_body(length: str | None, max_file_bytes: int) -> None:
    if length is None:
        # Without a length the body could only be measured after it was spooled to disk.
        raise OpenAIError(411, "an upload needs a Content-Length header")
    if not length.isdigit() or int(length) > max_file_bytes + _MULTIPART_SLACK_BYTES:
        raise _too_large(max_file_bytes)


def _too_large(max_file_bytes: int) -> OpenAIError:
    return OpenAIError(
        413,
        f"file: larger than this server's limit of {max_file_bytes} bytes "
        "(EXLQ_BATCH_MAX_FILE_BYTES); split the requests over several batches",
        param="file",
        code="file_too_large",
    )


async def _copy_batch_file(upload: UploadFile, writer: FileWriter, settings: BatchSettings) -> None:
    """Copies the upload into Redis, refusing it past the byte or the request limit."""
    lines = _LineCounter()
    while piece := await upload.read(FILE_CHUNK_BYTES):
        if writer.size + len(piece) > settings.max_file_bytes:
            raise _too_large(settings.max_file_bytes)
        lines.feed(piece)
        if lines.count > settings.max_requests:
            raise OpenAIError(
                400,
                f"file: more than {settings.max_requests} requests, this server's limit per "
                "batch (EXLQ_BATCH_MAX_REQUESTS); split them over several batches",
                param="file",
                code="too_many_requests",
            )
        await writer.write(piece)
    if writer.size == 0:
        raise OpenAIError(400, "file: the file is empty", param="file")


class _LineCounter:
    """Counts the lines that hold more than white space, fed piece by piece."""

    def __init__(self) -> None:
        self.count = 0
        self._open = False  # the last piece ended inside a line with content

    def feed(self, piece: bytes) -> None:
        for index, line in enumerate(piece.split(b"\n")):
            if index > 0:
                self._open = False
            if line.strip() and not self._open:
                self.count += 1
                self._open = True


@router.get("/v1/files")
async def list_files(
    request: Request,
    purpose: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10_000)] = 10_000,
    order: Literal["asc", "desc"] = "desc",
) -> dict[str, Any]:
    page = await file_store(request).page(
        purpose=purpose, after=after, limit=limit, newest_first=order == "desc"
    )
    return page.body()


@router.get("/v1/files/{file_id}")
async def retrieve_file(request: Request, file_id: str) -> dict[str, Any]:
    found = await file_store(request).get(file_id)
    if found is None:
        raise not_found(file_id)
    return found


@router.get("/v1/files/{file_id}/content")
async def file_content(request: Request, file_id: str) -> StreamingResponse:
    store = file_store(request)
    found = await store.get(file_id)
    if found is None:
        raise not_found(file_id)
    pieces: AsyncIterator[bytes] = store.pieces(file_id)
    return StreamingResponse(
        pieces,
        media_type="application/octet-stream",
        headers={
            "content-length": str(found["bytes"]),
            "content-disposition": f'attachment; filename="{_safe(found["filename"])}"',
        },
    )


def _safe(filename: str) -> str:
    return (
        "".join(c for c in filename if c.isascii() and c.isprintable() and c not in '"\\')[:200]
        or "file"
    )


@router.delete("/v1/files/{file_id}")
async def delete_file(request: Request, file_id: str) -> dict[str, Any]:
    if not await file_store(request).delete(file_id):
        raise not_found(file_id)
    return {"id": file_id, "object": "file", "deleted": True}

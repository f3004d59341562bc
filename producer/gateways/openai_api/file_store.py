"""Files in Redis, in OpenAI's shape: a hash of what describes the file, its bytes as a list
of pieces of at most FILE_CHUNK_BYTES (no Redis value may pass proto-max-bulk-len), and one
sorted set of every file by creation time. A file's keys share the hash tag ``{file_id}``."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, Literal, cast

import redis.asyncio as aioredis
from redis.typing import EncodableT, FieldT

from exlq.producer.gateways.openai_api.batch_settings import FILE_CHUNK_BYTES
from exlq.producer.gateways.openai_api.list_page import ListPage

FilePurpose = Literal["batch", "batch_output"]
FILE_ID_PATTERN = re.compile(r"^file-[A-Za-z0-9_-]{1,64}$")
# Pieces read per round trip while streaming a file back.
_PIECES_PER_READ = 4


def new_file_id() -> str:
    return f"file-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FileKeys:
    prefix: str

    @property
    def index(self) -> str:
        """Sorted set of every file id, scored by creation time."""
        return f"{self.prefix}:files"

    def meta(self, file_id: str) -> str:
        return f"{self.prefix}:file:{{{file_id}}}"

    def pieces(self, file_id: str) -> str:
        return f"{self.prefix}:file:{{{file_id}}}:pieces"


def file_object(meta: dict[bytes, bytes]) -> dict[str, Any]:
    """OpenAI's file object from the stored hash."""
    text = {k.decode(): v.decode() for k, v in meta.items()}
    return {
        "id": text["id"],
        "object": "file",
        "bytes": int(text["bytes"]),
        "created_at": int(text["created_at"]),
        "filename": text["filename"],
        "purpose": text["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


class FileWriter:
    """Writes one file's bytes in pieces; the file is listed only once ``finish`` runs, so
    a reader never sees half a file. Writing again under the same id starts over."""

    def __init__(self, store: FileStore, file_id: str) -> None:
        self._store = store
        self.file_id = file_id
        self._held = bytearray()
        self.size = 0
        self._started = False

    async def write(self, data: bytes) -> None:
        if not self._started:
            await self._store.redis.delete(self._store.keys.pieces(self.file_id))
            self._started = True
        self._held += data
        self.size += len(data)
        while len(self._held) >= FILE_CHUNK_BYTES:
            await self._push(bytes(self._held[:FILE_CHUNK_BYTES]))
            del self._held[:FILE_CHUNK_BYTES]

    async def _push(self, piece: bytes) -> None:
        await self._store.redis.rpush(self._store.keys.pieces(self.file_id), piece)

    async def finish(self, filename: str, purpose: FilePurpose) -> dict[str, Any]:
        if not self._started:
            await self.write(b"")
        if self._held:
            await self._push(bytes(self._held))
            self._held.clear()
        now = time.time()
        meta: dict[FieldT, EncodableT] = {
            "id": self.file_id,
            "bytes": str(self.size),
            "created_at": str(int(now)),
            "filename": filename,
            "purpose": purpose,
        }
        keys = self._store.keys
        await self._store.redis.hset(keys.meta(self.file_id), mapping=meta)
        await self._store.redis.zadd(keys.index, {self.file_id: now})
        return file_object({str(k).encode(): str(v).encode() for k, v in meta.items()})

    async def abort(self) -> None:
        await self._store.redis.delete(self._store.keys.pieces(self.file_id))


class FileStore:
    def __init__(self, redis: aioredis.Redis, prefix: str) -> None:
        self.redis = redis
        self.keys = FileKeys(prefix)

    def writer(self, file_id: str | None = None) -> FileWriter:
        return FileWriter(self, file_id or new_file_id())

    async def get(self, file_id: str) -> dict[str, Any] | None:
        if not FILE_ID_PATTERN.fullmatch(file_id):
            return None
        meta = cast("dict[bytes, bytes]", await self.redis.hgetall(self.keys.meta(file_id)))
        return file_object(meta) if meta else None

    async def delete(self, file_id: str) -> bool:
        if not FILE_ID_PATTERN.fullmatch(file_id):
            return False
        removed = await self.redis.zrem(self.keys.index, file_id)
        deleted = await self.redis.delete(self.keys.meta(file_id), self.keys.pieces(file_id))
        return bool(removed or deleted)

    async def pieces(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's bytes, a few pieces per read: never the whole file at once."""
        key = self.keys.pieces(file_id)
        count = await self.redis.llen(key)
        for start in range(0, count, _PIECES_PER_READ):
            read = await self.redis.lrange(key, start, start + _PIECES_PER_READ - 1)
            for piece in cast("list[bytes]", read):
                yield piece

    async def lines(self, file_id: str) -> AsyncIterator[bytes]:
        """The file's lines, without their line ends; a last line without one too."""
        rest = b""
        async for piece in self.pieces(file_id):
            parts = (rest + piece).split(b"\n")
            rest = parts.pop()
            for line in parts:
                yield line.removesuffix(b"\r")
        if rest:
            yield rest.removesuffix(b"\r")

    async def page(
        self,
        *,
        purpose: str | None,
        after: str | None,
        limit: int,
        newest_first: bool,
        read_chunk: int = 500,
    ) -> ListPage:
        """Files after ``after`` in the order asked, of one purpose if given."""
        start = await self._start_rank(after, newest_first)
        found: list[dict[str, Any]] = []
        while len(found) <= limit:
            ids = await self._ids(start, read_chunk, newest_first)
            if not ids:
                break
            start += len(ids)
            found += await self._objects(ids, purpose)
        return ListPage(found[:limit], len(found) > limit)

    async def _start_rank(self, after: str | None, newest_first: bool) -> int:
        if after is None:
            return 0
        rank = await (self.redis.zrevrank if newest_first else self.redis.zrank)(
            self.keys.index, after
        )
        # An id no longer listed (deleted) has nothing after it.
        return 1 << 62 if rank is None else int(cast("int", rank)) + 1

    async def _ids(self, start: int, count: int, newest_first: bool) -> list[str]:
        read = self.redis.zrevrange if newest_first else self.redis.zrange
        return [
            i.decode()
            for i in cast("list[bytes]", await read(self.keys.index, start, start + count - 1))
        ]

    async def _objects(self, ids: list[str], purpose: str | None) -> list[dict[str, Any]]:
        pipe = self.redis.pipeline(transaction=False)
        for file_id in ids:
            pipe.hgetall(self.keys.meta(file_id))
        metas = cast("list[dict[bytes, bytes]]", await pipe.execute())
        objects = [file_object(meta) for meta in metas if meta]
        return [o for o in objects if purpose is None or o["purpose"] == purpose]

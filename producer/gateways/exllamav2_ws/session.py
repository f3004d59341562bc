"""One client connection: its sends, and the infer requests it has in flight, which its
`stop` and its closing cancel (and nobody else's)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

from redis.exceptions import RedisError
from websockets.asyncio.server import ServerConnection
from websockets.exceptions import ConnectionClosed

from exlq.producer.client import JobHandle
from exlq.producer.gateways.exllamav2_ws.protocol import Message

log = logging.getLogger(__name__)


class RunningInfer:
    """An infer from its arrival to its last message; its job once submitted."""

    def __init__(self) -> None:
        self.handle: JobHandle | None = None
        self.stopped = False

    async def attach(self, handle: JobHandle) -> None:
        """The job is submitted: cancel it at once if a stop came while it was on its way."""
        self.handle = handle
        if self.stopped:
            await self._cancel(handle)

    async def stop(self) -> None:
        self.stopped = True
        if self.handle is not None and not self.handle.finished:
            await self._cancel(self.handle)

    @staticmethod
    async def _cancel(handle: JobHandle) -> None:
        try:
            await handle.cancel()
        except (RedisError, OSError) as exc:
            # The job runs on to its end; its infer still answers with its full message.
            log.warning("could not cancel job %s: %s", handle.id, exc)


class Session:
    def __init__(self, websocket: ServerConnection) -> None:
        self._websocket = websocket
        self._running: set[RunningInfer] = set()

    async def send(self, message: Message) -> None:
        """Send, or drop the message where the client has gone: an infer whose client left
        runs on only until its cancelled job ends, so that its subscription is released."""
        with contextlib.suppress(ConnectionClosed):
            await self._websocket.send(json.dumps(message))

    def start_infer(self) -> RunningInfer:
        running = RunningInfer()
        self._running.add(running)
        return running

    def finish_infer(self, running: RunningInfer) -> None:
        self._running.discard(running)

    async def stop_all(self) -> None:
        """Cancel the jobs of every infer in flight on this connection."""
        await asyncio.gather(*(running.stop() for running in list(self._running)))

"""The worker's commands to its engine process: pickled messages in frames over a pipe.

The worker writes (FrameWriter); the engine process's stepping thread reads (FrameReader)
when it is idle, between steps and while a step waits for the GPU, with no thread of its
own in between. So the worker's writes never wait for a step: with an event loop, what
the pipe cannot take at once waits in a buffer that the loop writes once the pipe has room.
The pipe is widened to 1 MiB where Linux allows (widen_pipe), so a step's drain takes a
burst's offers in one read; a message larger than what the pipe holds is read to its end
once it has begun, while the worker's loop writes the rest. A frame is its payload's
length (8 bytes, big-endian) and the pickle."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import pickle
import select
import struct
import threading
from typing import Any

_HEADER = struct.Struct("!Q")
_READ_SIZE = 1 << 20
PIPE_BYTES = 1 << 20  # Linux's default pipe-max-size; a pipe holds 64 KiB unless widened


def widen_pipe(fd: int, size: int = PIPE_BYTES) -> int:
    """Ask Linux to let the pipe hold ``size`` bytes; returns what it holds (the request may
    be refused past the system's limits, and other systems keep their size)."""
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None)
    get_size = getattr(fcntl, "F_GETPIPE_SZ", None)
    if set_size is None or get_size is None:
        return 0
    with contextlib.suppress(OSError):
        fcntl.fcntl(fd, set_size, size)
    return int(fcntl.fcntl(fd, get_size))


def encode_frame(message: object) -> bytes:
    payload = pickle.dumps(message, pickle.HIGHEST_PROTOCOL)
    return _HEADER.pack(len(payload)) + payload


class FrameWriter:
    """Writes messages to a pipe. Without an event loop, send() blocks until the frame is in
    the pipe. attach(loop) makes the pipe non-blocking: send() then writes what the pipe
    takes and leaves the rest to the loop, in order; it may be called from any thread."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._pending = bytearray()  # written by the loop when the pipe has room
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread = 0
        self._flushing = False  # the loop watches the pipe for room
        self.broken = False  # the reader is gone: nothing more is written

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Call on the loop's thread, before the loop's first send."""
        os.set_blocking(self._fd, False)
        self._loop, self._loop_thread = loop, threading.get_ident()

    def detach(self) -> None:
        """Stop writing on the loop (before the pipe closes); what waits is dropped."""
        with self._lock:
            loop, self._loop = self._loop, None
            self._pending.clear()
            if loop is not None and self._flushing and not loop.is_closed():
                if threading.get_ident() == self._loop_thread:
                    loop.remove_writer(self._fd)
                else:
                    loop.call_soon_threadsafe(loop.remove_writer, self._fd)
            self._flushing = False

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def send(self, message: object) -> None:
        """Write one message. A reader that has gone (the engine process died) drops it:
        the report pipe tells the worker."""
        frame = encode_frame(message)
        with self._lock:
            if self.broken:
                return
            loop = self._loop
            if loop is not None and loop.is_closed():  # the worker is shutting down
                self._loop, loop = None, None
                os.set_blocking(self._fd, True)
                frame, self._pending = bytes(self._pending) + frame, bytearray()
            if loop is None:
                self._write_blocking(frame)
                return
            if not self._pending:
                written = self._write_some(frame)
                if written == len(frame) or self.broken:
                    return
                frame = frame[written:]
            self._pending += frame
            if not self._flushing:
                self._flushing = True
                if threading.get_ident() == self._loop_thread:
                    loop.add_writer(self._fd, self._flush)
                else:
                    loop.call_soon_threadsafe(loop.add_writer, self._fd, self._flush)

    def _flush(self) -> None:
        """On the loop, when the pipe has room: write what waits."""
        with self._lock:
            loop = self._loop
            if self._pending:
                written = self._write_some(bytes(self._pending))
                del self._pending[:written]
            if (not self._pending or self.broken) and loop is not None:
                self._pending.clear()
                loop.remove_writer(self._fd)
                self._flushing = False

    def _write_some(self, data: bytes) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # EPIPE, EBADF: the reader is gone
            self.broken = True
            return 0

    def _write_blocking(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                written = os.write(self._fd, view)
            except BlockingIOError:
                select.select([], [self._fd], [])
                continue
            except OSError:
                self.broken = True
                return
            view = view[written:]


class FrameReader:
    """Reads whole messages from a pipe. take() returns every message that has arrived; a
    frame still arriving stays buffered until its rest comes."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        os.set_blocking(fd, False)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._buffer = bytearray()
        self._ended = False  # the writer closed its end

    def take(self, block: bool) -> list[Any]:
        """The messages that have arrived; with ``block``, wait for at least one. A message
        whose start has arrived is waited for to its end. Raises EOFError once the writer
        has closed and every whole message was taken."""
        while True:
            self._read_arrived()
            while self._partial() and not self._ended:
                self._poll.poll()  # the writer is sending the rest
                self._read_arrived()
            messages = self._whole_messages()
            if messages or not (block or self._ended):
                return messages
            if self._ended:
                raise EOFError("the command pipe was closed")
            self._poll.poll()  # until readable, or the writer closes

    def _read_arrived(self) -> None:
        while not self._ended:
            try:
                data = os.read(self._fd, _READ_SIZE)
            except BlockingIOError:
                return
            if not data:
                self._ended = True
                return
            self._buffer += data
            if len(data) < _READ_SIZE:
                return  # the pipe is empty now; one read fewer

    def _partial(self) -> bool:
        """The buffer ends in part of a frame."""
        buffer, start = self._buffer, 0
        while len(buffer) - start >= _HEADER.size:
            (size,) = _HEADER.unpack_from(buffer, start)
            start += _HEADER.size + size
        return start != len(buffer)

    def _whole_messages(self) -> list[Any]:
        messages: list[Any] = []
        buffer, start = self._buffer, 0
        with memoryview(buffer) as view:
            while len(buffer) - start >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, start)
                end = start + _HEADER.size + size
                if len(buffer) < end:
                    break
                messages.append(pickle.loads(view[start + _HEADER.size : end]))
                start = end
        if start:
            del buffer[:start]
        return messages

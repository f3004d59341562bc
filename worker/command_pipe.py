"""The worker's commands to its engine process: MessagePack messages in frames over a pipe.

The worker writes (FrameWriter); the engine process's stepping thread reads (FrameReader)
when it is idle, between steps and while a step waits for the GPU, with no thread of its
own in between. So the worker's writes never wait for a step: with an event loop, what
the pipe cannot take at once waits in a buffer that the loop writes once the pipe has room.
The pipe is widened to 1 MiB where Linux allows (widen_pipe), so a step's drain takes a
burst's offers in one read; a message larger than what the pipe holds is read to its end
once it has begun, while the worker's loop writes the rest. A frame is its payload's
length (8 bytes, big-endian) and the command: one of the engine loop's commands (Offer,
Admit, Cancel, Stop), which msgspec writes as a MessagePack array, its tag first, and reads
back as that command, its requests as PackedRequests (engines/engine_request.py)."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import select
import struct
import threading
from collections.abc import Callable
from typing import Any, cast

import msgspec

from exlq.worker.engine_loop import Admit, Cancel, Command, Offer, Stop
from exlq.worker.engines.engine_request import (
    PackedRequest,
    decode_hook,
    encode_hook,
    ext_hook,
)

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


# What crosses the pipe: every command the engine loop takes, its requests packed.
PipeCommand = Offer[PackedRequest] | Admit[PackedRequest] | Cancel | Stop
_ENCODER = msgspec.msgpack.Encoder(enc_hook=encode_hook)
_DECODER = msgspec.msgpack.Decoder(PipeCommand, ext_hook=ext_hook, dec_hook=decode_hook)


def encode_frame(command: Command) -> bytearray:
    """One command's frame: written after room for its length, which then goes in front."""
    frame = bytearray(_HEADER.size)
    _ENCODER.encode_into(command, frame, _HEADER.size)
    _HEADER.pack_into(frame, 0, len(frame) - _HEADER.size)
    return frame


def decode_command(payload: bytes | memoryview) -> PipeCommand:
    """A frame's command (its payload: the frame past its length)."""
    return cast(PipeCommand, _DECODER.decode(payload))


class FrameWriter:
    """Writes messages to a pipe. Without an event loop, send() blocks until the frame is in
    the pipe. attach(loop) makes the pipe non-blocking: send() then writes what the pipe
    takes and leaves the rest to the loop, in order; it may be called from any thread.
    While bytes wait, the loop watches the pipe for room, and only then."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._pending = bytearray()  # written by the loop when the pipe has room
        self._loop: asyncio.AbstractEventLoop | None = None
        self.broken = False  # the reader is gone: nothing more is written

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """Write through ``loop`` from now on (before its first send)."""
        os.set_blocking(self._fd, False)
        self._loop = loop

    def detach(self) -> None:
        """Stop writing on the loop (before the pipe closes); what waits is dropped."""
        with self._lock:
            loop, self._loop = self._loop, None
            if loop is not None and self._pending and not loop.is_closed():
                _on_loop(loop, loop.remove_writer, self._fd)
            self._pending.clear()

    @property
    def pending_bytes(self) -> int:
        return len(self._pending)

    def send(self, command: Command) -> None:
        """Write one command. A reader that has gone (the engine process died) drops it:
        the report pipe tells the worker."""
        with self._lock:  # encoded under it: one thread at a time uses the encoder
            if self.broken:
                return
            frame = encode_frame(command)
            loop = self._loop
            if loop is not None and loop.is_closed():  # the worker is shutting down
                self._loop, loop = None, None
                os.set_blocking(self._fd, True)
                frame, self._pending = self._pending + frame, bytearray()
            if loop is None:
                self._write_blocking(frame)
                return
            if self._pending:  # the loop is waiting for room: this goes behind
                self._pending += frame
                return
            written = self._write_some(frame)
            if written < len(frame) and not self.broken:
                self._pending += frame[written:]
                _on_loop(loop, loop.add_writer, self._fd, self._flush)

    def _flush(self) -> None:
        """On the loop, when the pipe has room: write what waits."""
        with self._lock:
            written = self._write_some(self._pending)
            del self._pending[:written]
            if self.broken:
                self._pending.clear()
            if not self._pending and self._loop is not None:
                self._loop.remove_writer(self._fd)

    def _write_some(self, data: bytearray) -> int:
        try:
            return os.write(self._fd, data)
        except BlockingIOError:
            return 0
        except OSError:  # EPIPE, EBADF: the reader is gone
            self.broken = True
            return 0

    def _write_blocking(self, data: bytearray) -> None:
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


def _on_loop(loop: asyncio.AbstractEventLoop, call: Callable[..., object], *args: Any) -> None:
    """Run ``call`` on ``loop``'s thread: now if this is it, else as soon as it can."""
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if running is loop:
        call(*args)
    else:
        loop.call_soon_threadsafe(call, *args)


class FrameReader:
    """Reads whole commands from a pipe. take() returns every command that has arrived; a
    command whose start has arrived is read to its end first."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._poll = select.poll()
        self._poll.register(fd, select.POLLIN)
        self._buffer = bytearray()  # the start of a message still arriving
        self._ended = False  # the writer closed its end

    def take(self, block: bool) -> list[PipeCommand]:
        """The commands that have arrived; with ``block``, wait for at least one. Raises
        EOFError once the writer has closed and every whole command was taken."""
        while True:
            messages = self._read_arrived()
            while self._buffer and not self._ended:
                self._poll.poll()  # the writer is sending the rest
                messages += self._read_arrived()
            if messages or not (block or self._ended):
                return messages
            if self._ended:
                raise EOFError("the command pipe was closed")
            self._poll.poll()  # until readable, or the writer closes

    def _read_arrived(self) -> list[PipeCommand]:
        """The whole messages among what the pipe holds now. Between steps, when nothing has
        come, this is one poll() and no read."""
        while not self._ended and self._poll.poll(0):
            data = os.read(self._fd, _READ_SIZE)  # readable: returns at once
            if not data:
                self._ended = True
            self._buffer += data
            if len(data) < _READ_SIZE:
                break  # the pipe is empty now; one poll fewer
        return self._whole_messages()

    def _whole_messages(self) -> list[PipeCommand]:
        buffer, start = self._buffer, 0
        if len(buffer) < _HEADER.size:  # a step's look at an empty pipe ends here
            return []
        messages: list[PipeCommand] = []
        with memoryview(buffer) as view:
            while len(buffer) - start >= _HEADER.size:
                (size,) = _HEADER.unpack_from(buffer, start)
                end = start + _HEADER.size + size
                if len(buffer) < end:
                    break
                messages.append(_DECODER.decode(view[start + _HEADER.size : end]))
                start = end
        if start:
            del buffer[:start]
        return messages

"""The worker's commands to its engine process: frames over a pipe, read by the stepping
thread itself, and never a wait for the worker's event loop."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import queue
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest

from exlq.protocol.models import GenerationRequest
from exlq.worker.command_pipe import (
    PIPE_BYTES,
    FrameReader,
    FrameWriter,
    decode_command,
    encode_frame,
    widen_pipe,
)
from exlq.worker.engine_loop import Admit, Cancel, Command, EngineLoop, Offer, StepReport, Stop
from exlq.worker.engine_process import command_source
from exlq.worker.engines.base import JobEnded
from exlq.worker.engines.echo.engine import EchoEngine
from exlq.worker.engines.engine_request import PackedRequest, packed_request
from tests.engine_reports import collect_ends


@pytest.fixture
def pipe() -> Iterator[tuple[int, int]]:
    read_fd, write_fd = os.pipe()
    yield read_fd, write_fd
    for fd in (read_fd, write_fd):
        with contextlib.suppress(OSError):
            os.close(fd)


def _pipe_bytes(fd: int) -> int:
    return fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)


def test_messages_arrive_whole_and_in_order(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    reader, writer = FrameReader(read_fd), FrameWriter(write_fd)
    assert reader.take(block=False) == []
    messages = [Admit(1, [("a", None)]), Cancel("a"), Stop()]
    for message in messages:
        writer.send(message)
    assert reader.take(block=True) == messages


def test_a_message_larger_than_the_pipe_arrives_whole(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    reader, writer = FrameReader(read_fd), FrameWriter(write_fd)
    big = Cancel("x" * (4 * _pipe_bytes(write_fd)))
    sender = threading.Thread(target=writer.send, args=(big,))
    sender.start()  # blocks until the reader has taken what the pipe cannot hold
    taken: list[object] = []
    while not taken:
        taken = reader.take(block=True)
    sender.join(5)
    assert taken == [big]


@pytest.mark.parametrize("cut", [5, 12])  # within the length, within the command
def test_a_message_begun_is_read_to_its_end(pipe: tuple[int, int], cut: int) -> None:
    read_fd, write_fd = pipe
    reader = FrameReader(read_fd)
    frame = bytes(encode_frame(Cancel("job-1")))
    os.write(write_fd, frame[:cut])
    rest = threading.Timer(0.05, os.write, args=(write_fd, frame[cut:] + frame))
    begun = time.perf_counter()
    rest.start()
    # Not blocking for a new message, but a message whose start has come is taken whole.
    taken = reader.take(block=False)
    assert time.perf_counter() - begun >= 0.04
    rest.join()
    taken += reader.take(block=False)
    assert taken == [Cancel("job-1"), Cancel("job-1")]


def test_a_writer_gone_in_the_middle_of_a_message_ends_the_reading(
    pipe: tuple[int, int],
) -> None:
    read_fd, write_fd = pipe
    reader = FrameReader(read_fd)
    os.write(write_fd, encode_frame(Stop())[:6])
    os.close(write_fd)
    with pytest.raises(EOFError):
        reader.take(block=False)


def test_the_command_pipe_is_widened_where_linux_allows(pipe: tuple[int, int]) -> None:
    _, write_fd = pipe
    limit = int(Path("/proc/sys/fs/pipe-max-size").read_text())
    assert _pipe_bytes(write_fd) < min(PIPE_BYTES, limit)
    held = widen_pipe(write_fd)
    assert held == _pipe_bytes(write_fd) == min(PIPE_BYTES, limit)


def test_a_closed_writer_ends_the_reading_after_its_last_message(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    reader = FrameReader(read_fd)
    FrameWriter(write_fd).send(Stop())
    os.close(write_fd)
    assert reader.take(block=True) == [Stop()]
    with pytest.raises(EOFError):
        reader.take(block=True)
    with pytest.raises(EOFError):
        reader.take(block=False)


def test_a_send_to_a_gone_reader_is_dropped_quietly(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    writer = FrameWriter(write_fd)
    os.close(read_fd)
    writer.send(Cancel("a"))  # EPIPE: the engine process is gone
    assert writer.broken
    writer.send(Cancel("b"))


async def test_with_a_loop_a_full_pipe_never_blocks_the_sender(pipe: tuple[int, int]) -> None:
    read_fd, write_fd = pipe
    reader, writer = FrameReader(read_fd), FrameWriter(write_fd)
    writer.attach(asyncio.get_running_loop())
    big = Cancel("y" * (3 * _pipe_bytes(write_fd)))
    writer.send(big)  # returns at once; the rest waits for room
    writer.send(Admit(1, []))
    assert writer.pending_bytes > 0
    # Another thread's send goes behind what waits.
    await asyncio.to_thread(writer.send, Stop())
    taken: list[object] = []
    while len(taken) < 3:
        # The reader, in another process in service, takes what the loop writes as it
        # makes room.
        taken += await asyncio.to_thread(reader.take, False)
    assert taken == [big, Admit(1, []), Stop()]
    assert writer.pending_bytes == 0


async def test_a_detached_writer_drops_what_waits(pipe: tuple[int, int]) -> None:
    _, write_fd = pipe
    loop = asyncio.get_running_loop()
    writer = FrameWriter(write_fd)
    writer.attach(loop)
    writer.send(Cancel("z" * (2 * _pipe_bytes(write_fd))))
    assert writer.pending_bytes > 0
    writer.detach()
    assert writer.pending_bytes == 0
    assert not loop.remove_writer(write_fd)  # nothing is left watching the pipe


def _command_of(command: Command) -> object:
    return decode_command(encode_frame(command)[8:])  # past the frame's length


def test_each_message_becomes_its_command() -> None:
    request = GenerationRequest(prompt="hi", max_new_tokens=2)
    wire = packed_request(request)
    offer = _command_of(Offer(3, [("a", wire)]))
    assert isinstance(offer, Offer) and offer.round == 3 and offer.jobs[0][0] == "a"
    admit = _command_of(Admit(3, [("a", None), ("b", wire)]))
    assert isinstance(admit, Admit) and admit.round == 3
    assert admit.jobs[0] == ("a", None) and admit.jobs[1][1] is not None
    added = _command_of(Admit(None, [("c", wire)]))
    assert isinstance(added, Admit) and added.round is None
    assert _command_of(Cancel("a")) == Cancel("a")
    assert isinstance(_command_of(Stop()), Stop)
    # A command of another kind is refused, naming what it is not.
    with pytest.raises(msgspec.ValidationError, match="Invalid value 'reset'"):
        decode_command(msgspec.msgpack.encode(["reset"]))


def _request(prompt: str, tokens: int) -> PackedRequest:
    return packed_request(GenerationRequest(prompt=prompt, max_new_tokens=tokens))


@pytest.mark.parametrize("ending", ["stop", "close"])
def test_an_engine_loop_runs_the_commands_its_thread_reads(
    pipe: tuple[int, int], ending: str
) -> None:
    read_fd, write_fd = pipe
    writer = FrameWriter(write_fd)
    reports: queue.SimpleQueue[StepReport] = queue.SimpleQueue()
    engine = EchoEngine(capacity=4, tokens_per_second=1000)
    loop = EngineLoop(engine, commands=command_source(FrameReader(read_fd)))
    loop.start(reports.put)
    writer.send(Offer(1, [("a", _request("one", 2)), ("b", _request("two", 2))]))
    writer.send(Admit(1, [("a", None)]))  # b was offered, not admitted: it never runs
    writer.send(Admit(None, [("c", _request("three", 3))]))
    ended = collect_ends(reports, 2)
    assert sorted(ended, key=lambda e: e.job_id) == [
        JobEnded("a", "length", 1, 2),
        JobEnded("c", "length", 1, 3),
    ]
    with pytest.raises(RuntimeError, match="from its command source"):
        loop.add_many([("d", GenerationRequest(prompt="ignored", max_new_tokens=1))])
    if ending == "stop":
        writer.send(Stop())
    else:
        os.close(write_fd)  # the worker is gone
    loop.stop(5)  # waits: the stop comes through the pipe
    assert not loop._thread.is_alive()
    assert all(report.fatal is None for report in _drain(reports))


def _drain(reports: queue.SimpleQueue[StepReport]) -> list[StepReport]:
    drained = []
    while not reports.empty():
        drained.append(reports.get_nowait())
    return drained

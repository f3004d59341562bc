"""EngineProcess: the engine in a process of its own, so its Python never holds the GIL that
the worker's Redis I/O needs. Same interface as EngineLoop; reports come back over a pipe."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import threading
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection
from typing import Any, cast

import msgspec

from exlq.logs import configure_logging
from exlq.protocol.models import TokenChoices
from exlq.worker import tracing
from exlq.worker.command_pipe import FrameReader, FrameWriter, widen_pipe
from exlq.worker.engine_loop import (
    Admit,
    Cancel,
    Command,
    CommandSource,
    EngineLoop,
    Offer,
    ReportSink,
    StepReport,
    Stop,
)
from exlq.worker.engines.base import CacheUsage, EngineUnavailable, describe_error
from exlq.worker.engines.engine_request import EngineRequest, PackedRequest, packed_request
from exlq.worker.gc_pauses import HeldCollections, freeze_startup_heap
from exlq.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

LOAD_TIMEOUT_S = 1800.0


class EngineProcess:
    """Loads the engine in a spawned child (CUDA needs spawn, not fork) and relays to it."""

    def __init__(self, settings: WorkerSettings) -> None:
        self.settings = settings
        self.name: str = settings.serving.engine
        self.capacity = 0
        self.info: dict[str, str] = {}
        context = multiprocessing.get_context("spawn")
        # Pipe(duplex=False) returns (reader, writer).
        self._child_commands, self._commands = context.Pipe(duplex=False)
        self._reports, self._child_reports = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_child_main,
            args=(settings, self._child_commands, self._child_reports),
            name="exlq-engine",
            daemon=True,
        )
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None  # reading the reports
        self._reading_done = threading.Event()
        # Commands go out in frames the engine process's stepping thread reads itself
        # (command_pipe); the Connection only carries the pipe's end to the child.
        widen_pipe(self._commands.fileno())
        self._writer = FrameWriter(self._commands.fileno())

    def load(self, timeout_s: float = LOAD_TIMEOUT_S) -> None:
        """Start the child and wait until its engine is loaded; EngineUnavailable if it cannot."""
        self._process.start()
        # Drop our copies of the child's ends, so a dead child reads as EOF here.
        self._child_commands.close()
        self._child_reports.close()
        if not self._reports.poll(timeout_s):
            self.close()
            raise EngineUnavailable(f"the engine did not load within {timeout_s:.0f}s")
        try:
            message = decode_message(self._reports.recv_bytes())
        except EOFError:
            self.close()
            raise EngineUnavailable(
                f"the engine process exited while loading (code {self._process.exitcode})"
            ) from None
        if not isinstance(message, Ready):
            self.close()
            raise EngineUnavailable(message.reason if isinstance(message, Unavailable) else "")
        self.name, self.capacity, self.info = message.name, message.capacity, message.info

    @property
    def pid(self) -> int | None:
        """The engine process's id, once started (for profilers and CPU pinning)."""
        return self._process.pid

    def start(self, report: ReportSink, loop: asyncio.AbstractEventLoop | None = None) -> None:
        """Deliver the child's reports to ``report``. With ``loop`` (the caller's running
        event loop), the loop reads them from the pipe as they arrive and ``report`` runs on
        its thread, and the loop writes what of a command the pipe cannot take at once;
        stop() must then be called from another thread, and close() on the loop's.
        Without, a relay thread reads them and calls ``report`` from there, and a command
        is written whole before its call returns."""
        if loop is None:
            self._reader = threading.Thread(
                target=self._relay, args=(report,), name="exlq-engine-reports", daemon=True
            )
            self._reader.start()
            return
        # No relay thread between the pipe and the loop: a report reached the loop after
        # two wake-ups, the relay thread's and then the loop's, and now after one
        # (docs/PERFORMANCE.md, "The way back, and Redis (always on)").
        self._loop = loop
        loop.add_reader(self._reports.fileno(), self._read_reports, report)
        self._writer.attach(loop)  # a command never makes the loop wait for a step

    def _relay(self, report: ReportSink) -> None:
        while self._deliver(report):
            pass

    def _read_reports(self, report: ReportSink) -> None:
        """On the event loop, when the pipe is readable: every report that has arrived."""
        while self._deliver(report):
            try:
                if not self._reports.poll():
                    return  # read them all: the loop calls again when more arrive
            except OSError:
                return  # the pipe closed meanwhile: the next read reports it
        self._stop_reading()

    def _deliver(self, report: ReportSink) -> bool:
        """Read one message and hand a report on; False once nothing more will come."""
        try:
            message = decode_message(self._reports.recv_bytes())
        except (EOFError, OSError):
            code = self._process.exitcode
            report(
                StepReport(
                    [],
                    None,
                    0,
                    CacheUsage(0, 0),
                    fatal=f"the engine process ended (exit code {code})",
                )
            )
            return False
        if isinstance(message, StepReport):
            report(message)
        elif isinstance(message, Stopped):
            return False
        return True

    def _stop_reading(self) -> None:
        """Take the pipe off the event loop (reports stopped, or the runner closes)."""
        loop, self._loop = self._loop, None
        if loop is not None and not loop.is_closed():
            loop.remove_reader(self._reports.fileno())
        self._reading_done.set()

    # Requests cross the pipe packed (engine_request.PackedRequest), each a MessagePack
    # array that the child reads as the request its engine takes: pickling and unpickling a
    # GenerationRequest, a pydantic model, cost several times as much, on the way to a
    # burst's first step.
    def add_many(self, jobs: Sequence[tuple[str, EngineRequest]]) -> None:
        if jobs:  # one message: the child's engine admits them in one pass
            self._send(Admit(None, _packed(jobs)))

    def offer(self, round_id: int, jobs: Sequence[tuple[str, EngineRequest]]) -> None:
        if jobs:
            self._send(Offer(round_id, [(job_id, packed_request(r)) for job_id, r in jobs]))
            if tracing.tracer is not None:
                tracing.tracer.stage("offer_sent", n=len(jobs))

    def admit(self, round_id: int, jobs: Sequence[tuple[str, EngineRequest | None]]) -> None:
        # The requests offered in this round cross the pipe once: admit names them by id.
        self._send(Admit(round_id, _packed(jobs)))
        if tracing.tracer is not None:
            tracing.tracer.stage("admit_sent", n=len(jobs))

    def cancel(self, job_id: str) -> None:
        self._send(Cancel(job_id))

    def _send(self, command: Command) -> None:
        self._writer.send(command)  # a dead child drops it: the report pipe says so

    def stop(self, timeout: float | None = None) -> None:
        self._send(Stop())
        if self._reader is not None:
            self._reader.join(timeout)
        elif self._loop is not None:
            self._reading_done.wait(timeout)
        self._process.join(timeout)

    def close(self) -> None:
        if self._loop is not None:
            self._stop_reading()  # before its pipe closes, and no report after close
        self._writer.detach()
        if self._process.is_alive():
            self._process.terminate()
            self._process.join(10)
        if self._process.is_alive():
            self._process.kill()
            self._process.join()
        self._commands.close()
        self._reports.close()


def _packed(
    jobs: Sequence[tuple[str, EngineRequest | None]],
) -> list[tuple[str, PackedRequest | None]]:
    """The jobs with their requests packed (an admit's None: a job offered before)."""
    return [(job_id, None if r is None else packed_request(r)) for job_id, r in jobs]


def _child_main(settings: WorkerSettings, commands: Connection, reports: Connection) -> None:
    configure_logging(settings.serving.log_level, settings.serving.log_format)
    tracing.trace_to_file(settings.serving.trace_file)  # spawned: the worker's tracer is not here
    from exlq.worker.engines import build_engine

    try:
        engine = build_engine(settings.serving.engine, settings.load_request())
    except EngineUnavailable as exc:
        reports.send_bytes(encode_message(Unavailable(str(exc))))
        return
    except Exception as exc:
        log.exception("engine failed to load")
        reason = f"the engine failed to load: {describe_error(exc)}"
        reports.send_bytes(encode_message(Unavailable(reason)))
        return
    # The engine, its model and its libraries are loaded: out of the collector's reach;
    # and no collection pauses a burst on its way to the GPU.
    # The stepping thread reads the worker's commands itself: no command thread wakes it.
    source = command_source(FrameReader(commands.fileno()))
    loop = EngineLoop(engine, HeldCollections(), source)
    freeze_startup_heap()
    reports.send_bytes(encode_message(Ready(engine.name, engine.capacity, loop.info)))
    send_lock = threading.Lock()

    # On the engine thread, between steps. A sender thread of its own was rejected: its
    # wake-ups took the GIL back from the engine thread in the middle of exllamav2's host
    # code, lengthening every step (docs/PERFORMANCE.md, "Tried and rejected").
    def send_report(report: StepReport) -> None:
        if tracing.tracer is not None:
            held_ms = (time.time() - report.finished_at) * 1000  # held for the next GPU wait
            tracing.tracer.stage("report_sent", outputs=len(report.outputs), held_ms=held_ms)
        with send_lock:  # encoded under it: one thread at a time uses the encoder
            reports.send_bytes(encode_message(report))

    loop.start(send_report)
    try:
        loop.stop()  # ends on the worker's stop, its pipe's end, or the engine's death
    finally:
        engine.close()
        with send_lock, contextlib.suppress(OSError):
            reports.send_bytes(encode_message(Stopped()))


# What the engine process sends the worker: once Ready (or Unavailable, and it ends), then a
# StepReport per pass of its loop, and Stopped last. msgspec writes each as a MessagePack
# array, its tag first, and reads it back as what it was: a report's outputs stay
# TokenChunk, JobEnded and JobErrored (engines/base.py). The engine thread writes the
# reports between two steps, once for every job that made a token.
class Ready(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="ready"):
    name: str
    capacity: int
    info: dict[str, str]


class Unavailable(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="unavailable"):
    reason: str


class Stopped(msgspec.Struct, array_like=True, frozen=True, gc=False, tag="stopped"):
    pass


EngineMessage = StepReport | Ready | Unavailable | Stopped


def _encode_hook(value: object) -> object:
    if isinstance(value, TokenChoices):  # logprobs, when a job asks for them
        return value.model_dump()
    raise NotImplementedError(f"no wire form for {type(value).__name__}")


def _decode_hook(kind: type, value: Any) -> object:
    if kind is TokenChoices:
        return TokenChoices.model_validate(value)
    raise NotImplementedError(f"no decoding for {kind.__name__}")


_MESSAGE_ENCODER = msgspec.msgpack.Encoder(enc_hook=_encode_hook)
_MESSAGE_DECODER = msgspec.msgpack.Decoder(EngineMessage, dec_hook=_decode_hook)


def encode_message(message: EngineMessage) -> bytes:
    return _MESSAGE_ENCODER.encode(message)


def decode_message(data: bytes) -> EngineMessage:
    return cast(EngineMessage, _MESSAGE_DECODER.decode(data))


def encode_report(report: StepReport) -> bytes:
    """A step report as the engine thread writes it to the pipe."""
    return _MESSAGE_ENCODER.encode(report)


def decode_report(data: bytes) -> StepReport:
    """A step report as the worker reads it from the pipe."""
    message = _MESSAGE_DECODER.decode(data)
    if not isinstance(message, StepReport):
        raise ValueError(f"expected a step report, got {type(message).__name__}")
    return message


def command_source(reader: FrameReader) -> CommandSource:
    """The engine loop's commands, read from the worker's pipe on the loop's own thread."""

    def take(block: bool) -> list[Command]:
        try:
            commands: list[Command] = list(reader.take(block))
        except EOFError:  # the worker is gone: nothing will read what we make
            return [Stop()]
        if tracing.tracer is not None:
            for command in commands:
                tracing.tracer.stage("command_read", kind=type(command).__name__.lower())
        return commands

    return take

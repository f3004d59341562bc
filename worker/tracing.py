"""Stage events along a job's way through the worker, for tracing tools; off unless installed.

The worker calls its tracer at a few named stages (a piece begun, a job parsed, a step
begun, a report sent, ...) as ``if tracing.tracer is not None: tracing.tracer.stage(...)``:
with none installed, a stage costs an attribute read and a comparison. A tracer stamps
each stage with ``time.perf_counter()``, which on Linux is CLOCK_MONOTONIC, one clock for
every process of the machine, so a benchmark can line both of the worker's processes up
with its own.

``install(tracer)`` sets this process's tracer (tests, a worker in-process). The engine
process is spawned and starts with none: a worker whose settings name a trace file
(``EXLQ_TRACE_FILE``, ServingSettings.trace_file) installs a FileTracer at the start of
both processes (``trace_to_file``), each appending a JSON line a stage to that one file.
For measurement tools only: a traced stage writes a line, a cost the untraced worker never
pays.
"""

from __future__ import annotations

import gc
import json
import os
import time
from pathlib import Path
from typing import Literal, Protocol

Stage = Literal[
    # the worker's event loop (runner.py; EngineProcess's side of the pipe)
    "piece_begun",  # the worker starts taking in a piece of entries it read: n
    "job_parsed",  # an entry is parsed into a request
    "offer_sent",  # jobs offered to the engine process ahead of their start: n
    "admit_sent",  # the engine process told to start jobs: n
    "piece_started",  # the start script answered for a piece's jobs: n
    "report_received",  # a step's report reached the event loop: outputs
    "commit_begun",  # a commit script is called
    "commit_ended",  # it returned
    # the engine's thread (engine_loop.py, engine_process.py)
    "command_read",  # the engine process read one of the worker's commands: kind
    "offer_prepared",  # offered jobs were checked and readied: n
    "jobs_added",  # admitted jobs went into the engine: n
    "built_ahead",  # the idle engine built offered jobs ahead of their admit
    "step_begun",  # an engine step begins: active
    "step_ended",  # it ended
    "report_sent",  # the engine process sends a step's report down its pipe: outputs, held_ms
    # either process, from a FileTracer
    "collected",  # a collection of 1 ms or more ended: begin, generation
]

Field = int | float | str


class Tracer(Protocol):
    def stage(self, name: Stage, /, **fields: Field) -> None:
        """A stage was reached now, on any of the process's threads."""
        ...


tracer: Tracer | None = None


def install(new: Tracer | None) -> Tracer | None:
    """Make ``new`` this process's tracer (None: none); returns the one it replaces."""
    global tracer
    previous, tracer = tracer, new
    return previous


class Recorder:
    """Keeps the stages in memory, as (time, name, fields), in the order they came."""

    def __init__(self) -> None:
        self.records: list[tuple[float, Stage, dict[str, Field]]] = []

    def stage(self, name: Stage, /, **fields: Field) -> None:
        # One append: the engine's thread and the event loop may record at once.
        self.records.append((time.perf_counter(), name, fields))

    def names(self) -> list[Stage]:
        return [name for _, name, _ in self.records]


class FileTracer:
    """Appends a JSON line a stage to ``path``: {"t", "pid", "stage", ...fields}. Each line
    is one write() to a file opened for appending, so the worker's processes share a file."""

    def __init__(self, path: Path) -> None:
        self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        self._pid = os.getpid()

    def stage(self, name: Stage, /, **fields: Field) -> None:
        record = {"t": time.perf_counter(), "pid": self._pid, "stage": name, **fields}
        os.write(self._fd, (json.dumps(record) + "\n").encode())

    def close(self) -> None:
        os.close(self._fd)


class CollectionClock:
    """A gc callback that reports each collection of ``COLLECTION_MIN_S`` or more as it ends."""

    def __init__(self, to: Tracer) -> None:
        self.to = to
        self.begin = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self.begin = time.perf_counter()
        elif time.perf_counter() - self.begin >= COLLECTION_MIN_S:
            self.to.stage("collected", begin=self.begin, generation=info["generation"])


COLLECTION_MIN_S = 0.001


def trace_to_file(path: Path | None) -> None:
    """At a process's start: where the settings name a trace file, trace this process's
    stages and its collections of a millisecond or more into it."""
    if path is None:
        return
    file_tracer = FileTracer(path)
    install(file_tracer)
    gc.callbacks.append(CollectionClock(file_tracer))

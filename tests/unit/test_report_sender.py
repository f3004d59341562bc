"""The engine process sends step reports from a thread of its own: all of them, in order."""

from __future__ import annotations

import multiprocessing

from worker.engine_loop import StepReport
from worker.engine_process import _ReportSender
from worker.engines.base import CacheUsage, JobEnded


def test_reports_arrive_in_order_and_close_sends_what_was_queued() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = _ReportSender(writer)
    for i in range(200):
        sender.put(StepReport([JobEnded(f"j{i}", "length", 1, i)], 0.001, 1, CacheUsage(i, 9)))
    sender.close()
    received = []
    while reader.poll(0.5):
        received.append(reader.recv())
    assert [kind for kind, _ in received] == ["report"] * 200
    assert [report.cache.pages_used for _, report in received] == list(range(200))


def test_a_closed_pipe_stops_the_sender_without_an_error() -> None:
    reader, writer = multiprocessing.Pipe(duplex=False)
    sender = _ReportSender(writer)
    reader.close()
    writer.close()
    sender.put(StepReport([], 0.001, 0, CacheUsage(0, 1)))
    sender.close(timeout=5)
    assert not sender._thread.is_alive()

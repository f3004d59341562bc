"""A job run by a worker leaves its end line in the log (worker/job_log.py)."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from exlq.producer import AsyncProducer

pytestmark = pytest.mark.integration


async def test_end_line_names_the_job_and_how_it_ended(
    redis_url: str, queue_name: str, start_worker: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="exlq.worker.job_log")
    await start_worker()
    async with AsyncProducer(redis_url, queue=queue_name) as producer:
        handle = await producer.submit("one two three", max_new_tokens=2, id="logged-1")
        result = await handle.result(timeout=10)
    assert result.finish_reason == "length"
    lines = [r for r in caplog.records if getattr(r, "job_id", None) == "logged-1"]
    assert [r.getMessage().split()[1] for r in lines] == ["taken", "started", "ended"]
    end = lines[-1]
    assert end.levelno == logging.INFO
    message = end.getMessage()
    assert message.startswith("job ended job_id=logged-1 ")
    assert f"queue={queue_name} lane=interactive attempt=1 finish_reason=length" in message
    assert "generated_tokens=2" in message
    assert end.duration_s >= end.queue_wait_s >= 0  # type: ignore[attr-defined]

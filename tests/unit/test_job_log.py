"""The worker's per-job log lines (worker/job_log.py): the end line's fields, as logfmt in a
text line and as keys in a JSON line."""

from __future__ import annotations

import json
import logging

import pytest

from exlq.logs import formatter, parse_log_format
from exlq.protocol.models import parse_request
from exlq.worker import job_log
from exlq.worker.engines.base import JobEnded, JobErrored
from exlq.worker.running_job import RunningJob

ENQUEUED = 1_000.0


def _job(lane_mark: str = "") -> RunningJob:
    request = parse_request('{"id": "job-7", "prompt": "say \\"hi\\" twice"}')
    job = RunningJob(
        job_id=request.id,
        entry_id=f"1-0{lane_mark}",
        request=request,
        channel="exlq:out:{job-7}",
        enqueued_at=ENQUEUED,
    )
    job.attempt = 2
    job.started_at = ENQUEUED + 0.25
    job.first_token_at = ENQUEUED + 0.5
    job.completion_tokens = 3
    return job


def _end_record(
    caplog: pytest.LogCaptureFixture, job: RunningJob, ended: object
) -> logging.LogRecord:
    caplog.set_level(logging.INFO, logger="exlq.worker.job_log")
    job_log.job_ended(job, "q1", ended, ENQUEUED + 2.0)  # type: ignore[arg-type]
    [record] = [r for r in caplog.records if r.name == "exlq.worker.job_log"]
    return record


def test_end_line_is_logfmt_with_every_field(caplog: pytest.LogCaptureFixture) -> None:
    record = _end_record(caplog, _job("@batch"), JobEnded("job-7", "length", 11, 16, 4))
    assert record.levelno == logging.INFO
    pairs = dict(part.split("=", 1) for part in record.getMessage().split()[2:])
    assert record.getMessage().startswith("job ended ")
    assert pairs == {
        "job_id": "job-7",
        "queue": "q1",
        "lane": "batch",
        "attempt": "2",
        "finish_reason": "length",
        "prompt_tokens": "11",
        "generated_tokens": "16",
        "queue_wait_s": "0.25",
        "ttft_s": "0.5",
        "duration_s": "2",
    }


def test_worker_chosen_stop_reason_wins(caplog: pytest.LogCaptureFixture) -> None:
    job = _job()
    job.stop_reason = "expired"
    record = _end_record(caplog, job, JobEnded("job-7", "cancelled", 11, 0))
    assert record.finish_reason == "expired"  # type: ignore[attr-defined]


def test_json_mode_parses_with_the_fields(caplog: pytest.LogCaptureFixture) -> None:
    job = _job()
    job.first_token_at = None
    record = _end_record(caplog, job, JobErrored("job-7", "engine_error", "boom"))
    line = json.loads(formatter(parse_log_format("json")).format(record))
    assert line["levelname"] == "INFO"
    assert line["name"] == "exlq.worker.job_log"
    assert line["job_id"] == "job-7"
    assert line["queue"] == "q1"
    assert line["lane"] == "interactive"
    assert line["attempt"] == 2
    assert line["error"] == "engine_error"
    assert "finish_reason" not in line
    assert line["prompt_tokens"] is None
    assert line["generated_tokens"] == 3
    assert line["ttft_s"] is None
    assert line["duration_s"] == 2.0


def test_values_with_spaces_or_quotes_are_quoted() -> None:
    text = str(job_log.Logfmt({"a": 'x "y"', "b": "", "c": None, "d": "plain"}))
    assert text == 'a="x \\"y\\"" b="" c="" d=plain'


def test_debug_lines_only_when_debug_is_on(caplog: pytest.LogCaptureFixture) -> None:
    job = _job()
    caplog.set_level(logging.INFO, logger="exlq.worker.job_log")
    job_log.job_taken(job, "q1")
    job_log.job_started(job, "q1")
    assert not caplog.records
    caplog.set_level(logging.DEBUG, logger="exlq.worker.job_log")
    job_log.job_taken(job, "q1")
    job_log.job_started(job, "q1")
    taken, started = caplog.records
    assert taken.getMessage() == "job taken job_id=job-7 queue=q1 lane=interactive entry=1-0"
    assert started.getMessage().startswith("job started job_id=job-7 queue=q1 ")
    assert "attempt=2 queue_wait_s=0.25" in started.getMessage()


def test_unknown_log_format_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="use text or json"):
        parse_log_format("xml")

"""Step reports cross the engine process's pipe as MessagePack arrays and come back equal."""

from __future__ import annotations

from msgspec.structs import fields

from exlq.protocol.models import TokenChoices, TokenLogprob
from exlq.worker.engine_loop import StepReport
from exlq.worker.engine_process import decode_report, encode_report
from exlq.worker.engines.base import CacheUsage, JobEnded, JobErrored, TokenChunk


def test_every_kind_of_output_survives_the_pipe() -> None:
    choices = [TokenChoices(top=[TokenLogprob(token="a", token_id=7, logprob=-0.5)])]
    report = StepReport(
        [
            TokenChunk("j1", " word", [12, 34], None),
            TokenChunk("j2", "é", [99], choices),
            JobEnded("j1", "length", 256, 128, 17),
            JobEnded("j4", "stop", 10, 40, 0, draft_tokens=48, accepted_draft_tokens=30),
            JobErrored("j3", "invalid_request", "prompt too long"),
        ],
        0.0031,
        2,
        CacheUsage(12, 256),
        1_700_000_000.25,
        None,
    )
    wire = encode_report(report)
    assert decode_report(wire) == report


def test_a_fatal_report_survives_the_pipe() -> None:
    report = StepReport([], None, 0, CacheUsage(0, 0), 5.0, "CUDA context is lost")
    assert decode_report(encode_report(report)) == report


def test_the_encoding_knows_every_field_of_the_outputs() -> None:
    # The wire writes these fields in this order (array_like): a field added at the end of
    # an output reads as its default from an older engine process.
    assert [f.name for f in fields(TokenChunk)] == ["job_id", "text", "token_ids", "logprobs"]
    assert [f.name for f in fields(JobEnded)] == [
        "job_id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "cached_tokens",
        "draft_tokens",
        "accepted_draft_tokens",
    ]
    assert [f.name for f in fields(JobErrored)] == ["job_id", "code", "message"]
    assert [f.name for f in fields(StepReport)] == [
        "outputs",
        "step_seconds",
        "active_jobs",
        "cache",
        "finished_at",
        "fatal",
    ]

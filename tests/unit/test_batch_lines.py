"""A batch's lines: the input checks, the job ids, and the output and error lines in
OpenAI's shapes; a file's pieces read back as lines (fakeredis)."""

from __future__ import annotations

import json

import fakeredis
import pytest

from exlq.producer.gateways.openai_api.batch_lines import (
    InputCheck,
    failed_line,
    job_id,
    output_line,
    parse_line_body,
    request_id,
    stopped_line,
)
from exlq.producer.gateways.openai_api.batch_settings import FILE_CHUNK_BYTES
from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.file_store import FileStore

CHAT = "/v1/chat/completions"


def _line(**fields: object) -> bytes:
    request = {"custom_id": "a", "method": "POST", "url": CHAT, "body": {"model": "m"}}
    request.update(fields)
    return json.dumps(request).encode()


@pytest.mark.parametrize(
    ("raw", "code", "param"),
    [
        (b"{nope", "invalid_json_line", None),
        (b"[1, 2]", "invalid_json_line", None),
        (b"\xff\xfe", "invalid_json_line", None),
        (_line(custom_id=""), "missing_required_parameter", "custom_id"),
        (_line(custom_id=7), "missing_required_parameter", "custom_id"),
        (_line(method="GET"), "invalid_method", "method"),
        (_line(url="/v1/completions"), "mismatched_url", "url"),
        (_line(body="text"), "missing_required_parameter", "body"),
        (_line(body={"model": "m", "pad": "x" * 400}), "line_too_large", None),
    ],
)
def test_a_bad_line_is_named_with_its_number_and_reason(
    raw: bytes, code: str, param: str | None
) -> None:
    problem = InputCheck(CHAT, max_line_bytes=300).problem(9, raw)
    assert problem is not None
    assert (problem["code"], problem["param"], problem["line"]) == (code, param, 9)


def test_a_custom_id_may_appear_once() -> None:
    check = InputCheck(CHAT, max_line_bytes=10_000)
    assert check.problem(1, _line()) is None
    repeated = check.problem(2, _line())
    assert repeated is not None and repeated["code"] == "duplicate_custom_id"
    assert check.problem(3, _line(custom_id="b")) is None


def test_job_ids_are_the_same_every_time_and_valid_queue_names() -> None:
    assert job_id("batch_ab", 3, 1) == "batch_ab-3-1" == job_id("batch_ab", 3, 1)
    assert request_id("batch_ab", 3) == request_id("batch_ab", 3) != request_id("batch_ab", 4)
    assert request_id("batch_ab", 3).startswith("batch_req_")


def test_output_and_error_lines_have_openais_shape() -> None:
    done = json.loads(output_line("batch_x", 0, "c0", {"object": "chat.completion"}))
    assert done == {
        "id": request_id("batch_x", 0),
        "custom_id": "c0",
        "response": {
            "status_code": 200,
            "request_id": request_id("batch_x", 0),
            "body": {"object": "chat.completion"},
        },
        "error": None,
    }
    failed = json.loads(failed_line("batch_x", 1, "c1", OpenAIError(400, "bad", param="n")))
    assert failed["response"]["status_code"] == 400 and failed["error"] is None
    assert failed["response"]["body"]["error"]["param"] == "n"
    stopped = json.loads(stopped_line("batch_x", 2, "c2", "batch_expired"))
    assert stopped["response"] is None and stopped["error"]["code"] == "batch_expired"


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"logprobs": True, "top_logprobs": 2}, "logprobs"),
        ({"logprobs": True}, "logprobs"),
        ({"stream": True}, "stream"),
    ],
)
def test_a_line_a_stored_result_cannot_answer_is_refused(
    body: dict[str, object], param: str
) -> None:
    full = {"model": "m", "messages": [{"role": "user", "content": "hi"}], **body}
    with pytest.raises(OpenAIError) as refused:
        parse_line_body(CHAT, full)
    assert (refused.value.status, refused.value.param) == (400, param)


async def test_lines_split_across_pieces_come_back_whole() -> None:
    client = fakeredis.FakeAsyncRedis()
    store = FileStore(client, "exlq")
    lines = [b"x" * (FILE_CHUNK_BYTES // 3 + i) for i in range(7)]
    writer = store.writer()
    await writer.write(b"\r\n".join(lines))  # Windows line ends, no last line end
    await writer.finish("in.jsonl", "batch")
    pieces = [p async for p in store.pieces(writer.file_id)]
    assert max(len(p) for p in pieces) <= FILE_CHUNK_BYTES and len(pieces) > 1
    assert [line async for line in store.lines(writer.file_id)] == lines
    await client.aclose()

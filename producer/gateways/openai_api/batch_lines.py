"""One line of a batch: the checks of an input line, the job ids it runs under, and the
output and error lines it ends as, in OpenAI's shapes."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.translate import ParsedRequest, parse_body

# A file with more bad lines than this reports the first ones: the batch object stays small.
MAX_REPORTED_ERRORS = 100
_STOPPED_MESSAGES = {
    "batch_expired": "This request could not be executed before the completion window expired.",
    "batch_cancelled": "This request was not executed: the batch was cancelled.",
}


def job_id(batch_id: str, line: int, choice: int) -> str:
    """The job of one choice of one line: the same after a crash, so a submit sent again
    finds the job it made (the SDK dedupes on the id)."""
    return f"{batch_id}-{line}-{choice}"


def request_id(batch_id: str, line: int) -> str:
    digest = hashlib.blake2b(f"{batch_id}:{line}".encode(), digest_size=12).hexdigest()
    return f"batch_req_{digest}"


def batch_error(
    code: str, message: str, line: int | None = None, param: str | None = None
) -> dict[str, Any]:
    """One entry of a batch's ``errors.data``."""
    return {"code": code, "message": message, "param": param, "line": line}


@dataclass
class InputCheck:
    """Checks an input file's lines in order (``line`` is the file's line number, from 1):
    a JSON object with a unique string custom_id, method POST, url the batch's endpoint and
    an object body. The body itself is read when the line is submitted: a bad body fails
    that request alone, as OpenAI does."""

    endpoint: str
    max_line_bytes: int

    def __post_init__(self) -> None:
        self.custom_ids: set[str] = set()

    def problem(self, line: int, raw: bytes) -> dict[str, Any] | None:
        if len(raw) > self.max_line_bytes:
            return batch_error(
                "line_too_large",
                f"the line is larger than this server's limit of {self.max_line_bytes} bytes "
                "(EXLQ_BATCH_MAX_LINE_BYTES)",
                line,
            )
        try:
            request = json.loads(raw)
        except ValueError:
            return batch_error("invalid_json_line", "the line is not valid JSON", line)
        if not isinstance(request, dict):
            return batch_error("invalid_json_line", "the line is not a JSON object", line)
        return self._field_problem(line, request)

    def _field_problem(self, line: int, request: dict[str, Any]) -> dict[str, Any] | None:
        custom_id = request.get("custom_id")
        if not isinstance(custom_id, str) or not custom_id:
            return batch_error(
                "missing_required_parameter",
                "custom_id: a non-empty string is required",
                line,
                "custom_id",
            )
        if custom_id in self.custom_ids:
            return batch_error(
                "duplicate_custom_id",
                f"custom_id {custom_id!r} is used by an earlier line",
                line,
                "custom_id",
            )
        self.custom_ids.add(custom_id)
        if request.get("method") != "POST":
            return batch_error("invalid_method", "method: only POST is supported", line, "method")
        if request.get("url") != self.endpoint:
            return batch_error(
                "mismatched_url",
                f"url: {request.get('url')!r} is not the batch's endpoint {self.endpoint!r}",
                line,
                "url",
            )
        if not isinstance(request.get("body"), dict):
            return batch_error(
                "missing_required_parameter", "body: an object is required", line, "body"
            )
        return None


def read_line(raw: bytes) -> tuple[str, dict[str, Any]]:
    """The custom_id and body of a line InputCheck passed."""
    request = json.loads(raw)
    return request["custom_id"], request["body"]


def parse_line_body(endpoint: str, body: dict[str, Any]) -> ParsedRequest:
    """translate.parse_body, refusing what a stored result cannot answer: logprobs (the
    result keeps the text, not the tokens' logprobs) and streaming."""
    parsed = parse_body(endpoint, body)
    if parsed.top_logprobs is not None:
        raise OpenAIError(
            400,
            "logprobs: not supported in a batch by this server (a batch's stored results "
            "keep no logprobs); send the request online instead",
            param="logprobs",
        )
    if parsed.stream:
        raise OpenAIError(400, "stream: a batch's requests cannot stream", param="stream")
    return parsed


def output_line(batch_id: str, line: int, custom_id: str, body: dict[str, Any]) -> str:
    return _line(batch_id, line, custom_id, {"status_code": 200, "body": body}, None)


def failed_line(batch_id: str, line: int, custom_id: str, error: OpenAIError) -> str:
    """A request that failed as an online one would have: its status and error body."""
    response = {"status_code": error.status, "body": error.body()}
    return _line(batch_id, line, custom_id, response, None)


def stopped_line(batch_id: str, line: int, custom_id: str, code: str) -> str:
    """A request the batch's expiry or cancel stopped: no response, OpenAI's error code."""
    error = {"code": code, "message": _STOPPED_MESSAGES[code]}
    return _line(batch_id, line, custom_id, None, error)


def _line(
    batch_id: str,
    line: int,
    custom_id: str,
    response: dict[str, Any] | None,
    error: dict[str, str] | None,
) -> str:
    ids = request_id(batch_id, line)
    if response is not None:
        response = {
            "status_code": response["status_code"],
            "request_id": ids,
            "body": response["body"],
        }
    return json.dumps(
        {"id": ids, "custom_id": custom_id, "response": response, "error": error},
        separators=(",", ":"),
    )

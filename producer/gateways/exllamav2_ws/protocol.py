"""exllamav2's WebSocket messages, shaped as ExLlamaV2WebSocketServer (exllamav2 0.3.2,
exllamav2/server/websocket_actions.py) sends them, plus this gateway's error message.

Every reply starts with the request's ``action``, then its ``request_id`` and
``response_id`` where the request had them (any JSON value, echoed as sent). An ``infer``
adds its ``tag`` and ``util_text``; its chunks carry ``response_type: "chunk"`` and the
``chunk`` (and, with ``stream_full``, the ``response`` so far); its last message carries
``response_type: "full"``, ``chunk: ""`` (exllamav2 leaves the key set, emptied),
``stop_reason`` and the whole ``response``.

exllamav2's server has no error message (a bad request raises inside the server and the
client hears nothing). This gateway answers one on the request at fault: the reply's head
and ``tag``, then ``response_type: "error"``, ``error`` (a sentence that says what to fix)
and ``error_code`` (one of the codes below).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

from exlq.protocol.models import FinishReason

Message = dict[str, Any]

ACTIONS: Final = ("echo", "estimate_token", "lefttrim_token", "infer", "stop")

# exllamav2 reports a stop string as "eos" too: its streaming generator ends on either.
STOP_REASONS: Final[Mapping[FinishReason, str]] = {
    "stop": "eos",
    "length": "num_tokens",
    "cancelled": "interrupted",
    "expired": "interrupted",
}

# error_code values.
INVALID_JSON: Final = "invalid_json"  # not JSON, or JSON but not an object
UNKNOWN_ACTION: Final = "unknown_action"
INVALID_REQUEST: Final = "invalid_request"  # a field missing, of the wrong type or out of range
UNSUPPORTED: Final = "unsupported"  # an exllamav2 setting exlq cannot honour
NO_TOKENIZER: Final = "no_tokenizer"  # estimate_token / lefttrim_token without --tokenizer
QUEUE_FULL: Final = "queue_full"
NO_WORKERS: Final = "no_workers"
JOB_LOST: Final = "job_lost"
JOB_RESTARTED: Final = "job_restarted"
REDIS_UNAVAILABLE: Final = "redis_unavailable"
INTERNAL_ERROR: Final = "internal_error"
# A job's own error event passes its exlq code on: engine_error, too_many_attempts, ...


def reply_head(request: Mapping[str, Any]) -> Message:
    """The keys every reply to ``request`` starts with, as exllamav2's dispatch sets them."""
    head: Message = {}
    for key in ("action", "request_id", "response_id"):
        if key in request:
            head[key] = request[key]
    return head


def infer_head(request: Mapping[str, Any]) -> Message:
    """An infer's head: the reply head and the request's ``tag``, where it had one."""
    head = reply_head(request)
    if "tag" in request:
        head["tag"] = request["tag"]
    return head


def chunk_message(head: Message, util_text: str, chunk: str, so_far: str | None) -> Message:
    """One streamed piece; ``so_far`` (the response up to here) only with stream_full."""
    message = {**head, "util_text": util_text, "response_type": "chunk", "chunk": chunk}
    if so_far is not None:
        message["response"] = so_far
    return message


def full_message(head: Message, util_text: str, response: str, reason: FinishReason) -> Message:
    """An infer's last message."""
    return {
        **head,
        "util_text": util_text,
        "chunk": "",
        "stop_reason": STOP_REASONS[reason],
        "response_type": "full",
        "response": response,
    }


def error_message(head: Message, code: str, text: str) -> Message:
    return {**head, "response_type": "error", "error": text, "error_code": code}

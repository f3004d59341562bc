"""The WebSocket gateway's messages have exllamav2 0.3.2's keys, and its module loads only
with the exlq command (websockets and tokenizers stay out of `exlq`'s start)."""

from __future__ import annotations

import subprocess
import sys

from exlq.producer.gateways.exllamav2_ws.protocol import (
    chunk_message,
    error_message,
    full_message,
    infer_head,
    reply_head,
)
from tests.conftest import ROOT

REQUEST = {"action": "infer", "request_id": "r", "response_id": 4, "tag": [1], "text": "x"}


def test_heads_echo_what_the_request_had() -> None:
    assert reply_head(REQUEST) == {"action": "infer", "request_id": "r", "response_id": 4}
    assert reply_head({"action": "echo"}) == {"action": "echo"}
    assert infer_head(REQUEST) == {**reply_head(REQUEST), "tag": [1]}


def test_chunk_keys() -> None:
    head = infer_head(REQUEST)
    chunk = chunk_message(head, "x", " a", None)
    assert set(chunk) == {*head, "util_text", "response_type", "chunk"}
    assert chunk["response_type"] == "chunk" and chunk["chunk"] == " a"
    full = chunk_message(head, "x", " b", " a b")
    assert full["response"] == " a b"


def test_full_keys_and_stop_reasons() -> None:
    head = infer_head(REQUEST)
    message = full_message(head, "x", " a b", "length")
    assert set(message) == {*head, "util_text", "chunk", "stop_reason", "response_type", "response"}
    assert (message["chunk"], message["response_type"]) == ("", "full")
    reasons = {
        r: full_message(head, "", "", r)["stop_reason"]
        for r in ("stop", "length", "cancelled", "expired")
    }
    assert reasons == {
        "stop": "eos",
        "length": "num_tokens",
        "cancelled": "interrupted",
        "expired": "interrupted",
    }


def test_error_keys() -> None:
    message = error_message({"action": "echo"}, "invalid_request", "text: Field required")
    assert message == {
        "action": "echo",
        "response_type": "error",
        "error": "text: Field required",
        "error_code": "invalid_request",
    }


def test_the_exlq_command_starts_without_websockets_or_tokenizers() -> None:
    code = "import sys, exlq.cli; print(sorted({'websockets', 'tokenizers'} & set(sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    assert out.strip() == "[]"

"""The echo engine: deterministic text, stop strings held back, a set pace."""

from __future__ import annotations

import time
from typing import Any

import pytest

from exlq.protocol.models import ChatMessage, GenerationRequest, InvalidRequest
from exlq.worker.engines.base import JobEnded, TokenChunk
from exlq.worker.engines.echo.engine import EchoEngine, echo_text


def _run(engine: EchoEngine) -> list[object]:
    outputs: list[object] = []
    while engine.active_jobs:
        outputs += engine.step()
    return outputs


def test_text_cycles_the_prompt_words() -> None:
    request = GenerationRequest(prompt="to be or", max_new_tokens=5)
    engine = EchoEngine(2, 10_000)
    engine.add("j", request)
    outputs = _run(engine)
    text = "".join(o.text for o in outputs if isinstance(o, TokenChunk))
    assert text == echo_text(request) == " to be or to be"
    assert outputs[-1] == JobEnded("j", "length", 3, 5)


def test_stop_string_is_held_back_and_not_emitted() -> None:
    engine = EchoEngine(1, 10_000)
    engine.add("j", GenerationRequest(prompt="a b c", max_new_tokens=50, stop=["b c a"]))
    outputs = _run(engine)
    assert "".join(o.text for o in outputs if isinstance(o, TokenChunk)) == " a "
    assert isinstance(outputs[-1], JobEnded) and outputs[-1].finish_reason == "stop"


def test_messages_and_token_ids_are_echoed() -> None:
    engine = EchoEngine(2, 10_000)
    engine.add(
        "m",
        GenerationRequest(
            messages=[
                ChatMessage(role="system", content="ignored"),
                ChatMessage(role="user", content="hello"),
            ],
            max_new_tokens=2,
        ),
    )
    engine.add("t", GenerationRequest(input_ids=[7, 8], max_new_tokens=2))
    chunks = [o for o in _run(engine) if isinstance(o, TokenChunk)]
    assert "".join(c.text for c in chunks if c.job_id == "m") == " hello hello"
    assert "".join(c.text for c in chunks if c.job_id == "t") == " t7 t8"


def test_pace_is_tokens_per_second() -> None:
    engine = EchoEngine(1, 200)
    engine.add("j", GenerationRequest(prompt="x", max_new_tokens=20))
    started = time.monotonic()
    _run(engine)
    assert 0.08 <= time.monotonic() - started < 1.0


@pytest.mark.parametrize(
    "constrained",
    [
        {"regex": "[0-9]+"},
        {"response_format": {"type": "json_object"}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}},
    ],
)
def test_a_constrained_request_is_refused(constrained: dict[str, Any]) -> None:
    engine = EchoEngine(1, 10_000)
    with pytest.raises(InvalidRequest, match="echo engine does not constrain output"):
        engine.add("j", GenerationRequest.model_validate({"prompt": "a", **constrained}))
    assert not engine.active_jobs
    # Plain text is no constraint: it runs.
    engine.add("t", GenerationRequest(prompt="a", response_format={"type": "text"}))  # type: ignore[arg-type]
    assert engine.active_jobs == 1

"""SmolLM2's tokenizer saved by transformers 5 (the template in chat_template.jinja, as current
model repositories ship it): exlq's formatter finds the template and writes the prompt
transformers writes."""

from __future__ import annotations

from pathlib import Path

from exlq.protocol.models import ChatMessage
from exlq.worker.engines.base import Engine
from exlq.worker.engines.chat_template import ChatFormatter

QUESTION = [ChatMessage(role="user", content="What is the capital of France? Answer in one word.")]


def test_a_template_saved_by_transformers_5_renders_as_transformers_renders_it(
    engine: Engine, tmp_path: Path
) -> None:
    tokenizer = engine.tokenizer  # type: ignore[attr-defined]
    tokenizer.save_pretrained(tmp_path)
    assert (tmp_path / "chat_template.jinja").is_file()
    expected = tokenizer.apply_chat_template(
        [m.model_dump() for m in QUESTION], add_generation_prompt=True, tokenize=False
    )
    formatter = ChatFormatter(tmp_path, tokenizer.bos_token or "", tokenizer.eos_token or "")
    assert formatter.render(QUESTION) == expected

"""A request's prompt as the exllama engines hand it to their generators."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from exlq.protocol.models import GenerationRequest, InvalidRequest
from exlq.worker.engines.chat_template import ChatFormatter
from exlq.worker.engines.engine_request import packed_request
from exlq.worker.engines.exllama_prompt import prompt_tensor

torch = pytest.importorskip("torch")


class _Tokenizer:
    """Records how it was asked to encode."""

    def encode(self, text: str, add_bos: bool, encode_special_tokens: bool = False) -> Any:
        return (text, add_bos, encode_special_tokens)


@pytest.fixture
def chat(tmp_path: Path) -> ChatFormatter:
    (tmp_path / "chat_template.jinja").write_text(
        "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}<|assistant|>"
    )
    return ChatFormatter(tmp_path)


def test_ids_text_and_messages_each_become_the_generators_input(chat: ChatFormatter) -> None:
    tokenizer = _Tokenizer()
    ids = GenerationRequest(input_ids=[5, 6, 7], max_new_tokens=4)
    for request in (ids, packed_request(ids)):  # on the worker's thread, or in its process
        tensor = prompt_tensor(request, tokenizer, chat, 100)
        assert tensor.dtype == torch.int64 and tensor.tolist() == [[5, 6, 7]]
    text = GenerationRequest(prompt="Hello", max_new_tokens=4)
    assert prompt_tensor(text, tokenizer, chat, 100) == ("Hello", True, False)
    messages = GenerationRequest(
        messages=[{"role": "user", "content": "Hi"}],  # type: ignore[list-item]
        max_new_tokens=4,
    )
    assert prompt_tensor(messages, tokenizer, chat, 100) == ("<|user|>Hi<|assistant|>", False, True)


def test_an_id_outside_the_vocabulary_is_refused(chat: ChatFormatter) -> None:
    for ids in ([1, 100], [2**40]):
        request = GenerationRequest(input_ids=ids, max_new_tokens=4)
        with pytest.raises(InvalidRequest, match=r"outside the vocabulary \(0\.\.99\)"):
            prompt_tensor(packed_request(request), _Tokenizer(), chat, 100)

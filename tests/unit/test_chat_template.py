"""The chat template is read where transformers reads it, and a model without one refuses
messages instead of getting a prompt it was never trained on."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from exlq.protocol.models import ChatMessage, InvalidRequest
from exlq.worker.engines.chat_template import (
    ChatFormatter,
    generation_eos_ids,
    read_chat_template,
)

JINJA = (
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)
QUESTION = [ChatMessage(role="user", content="hi")]


def write(model_dir: Path, name: str, content: object) -> None:
    path = model_dir / name
    path.write_text(content if isinstance(content, str) else json.dumps(content))


def test_chat_template_jinja_is_read_as_transformers_5_saves_it(tmp_path: Path) -> None:
    write(tmp_path, "tokenizer_config.json", {"bos_token": "<s>"})  # no template there
    write(tmp_path, "chat_template.jinja", JINJA)
    assert ChatFormatter(tmp_path).render(QUESTION) == "<user>hi<assistant>"


def test_the_jinja_file_wins_over_tokenizer_config(tmp_path: Path) -> None:
    write(tmp_path, "tokenizer_config.json", {"chat_template": "old"})
    write(tmp_path, "chat_template.jinja", JINJA)
    assert read_chat_template(tmp_path) == JINJA


@pytest.mark.parametrize("name", ["tokenizer_config.json", "chat_template.json"])
def test_a_template_inside_json_files_is_read(tmp_path: Path, name: str) -> None:
    write(tmp_path, name, {"chat_template": JINJA})
    assert read_chat_template(tmp_path) == JINJA


def test_named_templates_give_the_default(tmp_path: Path) -> None:
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": JINJA}]
    write(tmp_path, "tokenizer_config.json", {"chat_template": named})
    assert read_chat_template(tmp_path) == JINJA


def test_a_model_without_a_template_refuses_messages_and_says_what_to_do(
    tmp_path: Path,
) -> None:
    write(tmp_path, "tokenizer_config.json", {"bos_token": "<s>"})
    chat = ChatFormatter(tmp_path)
    assert not chat.has_template
    with pytest.raises(InvalidRequest, match=r"no chat template.*send the text as prompt"):
        chat.render(QUESTION)


def test_a_template_that_raises_gives_an_invalid_request(tmp_path: Path) -> None:
    write(
        tmp_path,
        "chat_template.jinja",
        "{% if messages[0].role != 'system' %}"
        "{{ raise_exception('start with a system message') }}{% endif %}",
    )
    with pytest.raises(InvalidRequest, match="start with a system message"):
        ChatFormatter(tmp_path).render(QUESTION)


def test_templates_get_bos_and_eos_tokens(tmp_path: Path) -> None:
    template = "{{ bos_token }}{{ messages[0].content }}{{ eos_token }}"
    write(tmp_path, "chat_template.jinja", template)
    assert ChatFormatter(tmp_path, "<s>", "</s>").render(QUESTION) == "<s>hi</s>"


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ({"eos_token_id": 2}, {2}),
        ({"eos_token_id": [2, 49152]}, {2, 49152}),
        ({"bos_token_id": 1}, set()),
    ],
)
def test_generation_config_names_the_end_tokens(
    tmp_path: Path, config: dict[str, object], expected: set[int]
) -> None:
    write(tmp_path, "generation_config.json", config)
    assert generation_eos_ids(tmp_path) == expected


def test_no_generation_config_names_no_end_tokens(tmp_path: Path) -> None:
    assert generation_eos_ids(tmp_path) == frozenset()


def test_the_transformers_engine_refuses_messages_to_a_model_without_a_template() -> None:
    from exlq.protocol.models import GenerationRequest
    from exlq.worker.engines.transformers.prompt import chat_text

    class NoTemplate:
        chat_template = None

    request = GenerationRequest(messages=QUESTION)
    with pytest.raises(InvalidRequest, match="no chat template"):
        chat_text(request, NoTemplate())

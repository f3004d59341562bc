"""prompt_ids: a request's prompt as the model's token ids, whichever way the request gives it
(text, chat messages through the tokenizer's chat template, or token ids)."""

from __future__ import annotations

from typing import Any

from exlq.protocol.models import InvalidRequest
from exlq.worker.engines.chat_template import NO_TEMPLATE
from exlq.worker.engines.engine_request import EngineRequest


def prompt_ids(request: EngineRequest, tokenizer: Any, vocab_size: int) -> list[int]:
    """The prompt's ids; InvalidRequest for ids outside the vocabulary or an empty prompt."""
    if request.prompt_ids is not None:
        ids = list(request.prompt_ids)
        if max(ids) >= vocab_size:
            raise InvalidRequest(
                "the prompt's token ids (input_ids or input_ids_b64) hold an id outside the "
                f"vocabulary (0..{vocab_size - 1})"
            )
    elif request.messages is not None:
        # The template writes the special tokens (a BOS where the model wants one).
        text = chat_text(request, tokenizer)
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    else:
        ids = list(tokenizer(request.prompt or "")["input_ids"])
    if not ids:
        raise InvalidRequest("the prompt encodes to no tokens: give it some text")
    return ids


def chat_text(request: EngineRequest, tokenizer: Any) -> str:
    """The messages as the model's chat template writes them, ready for the reply (the
    tokenizer holds the template transformers found: chat_template.jinja, the
    tokenizer_config.json's, or a GGUF file's); InvalidRequest for a model without one."""
    messages = [{"role": m.role, "content": m.content} for m in request.messages or ()]
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidRequest(NO_TEMPLATE)
    from jinja2 import TemplateError

    try:
        text: str = tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
    except TemplateError as exc:
        raise InvalidRequest(f"messages: the model's chat template refused them: {exc}") from None
    return text

"""Turns chat messages into a prompt with the model's own chat template, read from where
transformers reads it, and finds the end-of-turn tokens the model's generation config names."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any, NoReturn

from exlq.protocol.models import ChatMessage, InvalidRequest

log = logging.getLogger(__name__)

# Where a model directory keeps its chat template, first found wins, as transformers 5
# reads them: it saves the template as chat_template.jinja; older saves put it in
# tokenizer_config.json, and processors in chat_template.json.
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_JSON_FILES = ("chat_template.json", "tokenizer_config.json")

NO_TEMPLATE = (
    "messages: this model ships no chat template (no chat_template.jinja, nor chat_template in "
    "chat_template.json or tokenizer_config.json), so exlq cannot tell how it expects a "
    "conversation: send the text as prompt (or input_ids), or add the template to the model "
    "directory"
)


class ChatFormatter:
    """Renders the model's chat template in a sandbox (templates are Jinja code shipped with
    model files). A model without one refuses messages: joining them some other way would
    give the model a prompt it was never trained on, and a silently worse answer."""

    def __init__(self, model_dir: Path, bos_token: str = "", eos_token: str = "") -> None:
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: Any = None
        source = read_chat_template(model_dir)
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            # The helpers transformers gives templates; many templates call them.
            env.globals["raise_exception"] = _raise_from_template
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(source)
        else:
            log.info("model has no chat template: requests with messages will be refused")

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[ChatMessage]) -> str:
        """The conversation as the model's template writes it, ready for the reply;
        InvalidRequest if the model has no template or the template refuses the messages."""
        if self._template is None:
            raise InvalidRequest(NO_TEMPLATE)
        from jinja2 import TemplateError

        try:
            rendered: str = self._template.render(
                messages=[m.model_dump() for m in messages],
                add_generation_prompt=True,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as exc:
            refused = f"messages: the model's chat template refused them: {exc}"
            raise InvalidRequest(refused) from None
        return rendered


def _raise_from_template(message: str) -> NoReturn:
    from jinja2 import TemplateError

    raise TemplateError(message)


def read_chat_template(model_dir: Path) -> str | None:
    """The model directory's default chat template, from where transformers reads one."""
    jinja = model_dir / TEMPLATE_FILE
    if jinja.is_file():
        return jinja.read_text()
    for name in TEMPLATE_JSON_FILES:
        path = model_dir / name
        if path.is_file():
            template = _default_template(json.loads(path.read_text()).get("chat_template"))
            if template is not None:
                return template
    return None


def _default_template(template: object) -> str | None:
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None


def generation_eos_ids(model_dir: Path) -> frozenset[int]:
    """The end-of-text tokens generation_config.json names (eos_token_id, one or a list): a
    chat model's end-of-turn token is often only there, not the tokenizer's eos_token."""
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return frozenset()
    ids = json.loads(path.read_text()).get("eos_token_id")
    if isinstance(ids, int):
        return frozenset((ids,))
    if isinstance(ids, list):
        return frozenset(i for i in ids if isinstance(i, int))
    return frozenset()

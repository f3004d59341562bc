"""Turns chat messages into a prompt with the model's own chat template, when it has one."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from exlq.protocol.models import ChatMessage

log = logging.getLogger(__name__)


class ChatFormatter:
    """Renders the ``chat_template`` of tokenizer_config.json in a sandbox (templates are
    Jinja code shipped with model files), or a plain role-prefixed layout without one."""

    def __init__(self, model_dir: Path, bos_token: str = "", eos_token: str = "") -> None:
        self.bos_token = bos_token
        self.eos_token = eos_token
        self._template: Any = None
        source = _read_template(model_dir)
        if source is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            self._template = env.from_string(source)
        else:
            log.info("model has no chat template; messages are joined as 'role: content' lines")

    @property
    def has_template(self) -> bool:
        return self._template is not None

    def render(self, messages: Sequence[ChatMessage]) -> str:
        if self._template is None:
            lines = [f"{m.role}: {m.content}" for m in messages]
            return "\n".join([*lines, "assistant:"])
        rendered: str = self._template.render(
            messages=[m.model_dump() for m in messages],
            add_generation_prompt=True,
            bos_token=self.bos_token,
            eos_token=self.eos_token,
        )
        return rendered


def _read_template(model_dir: Path) -> str | None:
    path = model_dir / "tokenizer_config.json"
    if not path.exists():
        return None
    template = json.loads(path.read_text()).get("chat_template")
    if isinstance(template, list):  # named templates: take the default one
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default")
    return template if isinstance(template, str) else None

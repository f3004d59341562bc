"""OpenAI parameters exlq cannot honour: accepted at their "off" value, refused (400, the
parameter named) at any other, so that a client never gets an answer that silently ignored
what it asked for."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from exlq.producer.gateways.openai_api.errors import OpenAIError
from exlq.producer.gateways.openai_api.request_models import ChatBody, CompletionBody


def _off(value: Any) -> bool:
    """None, False, an empty list or dict: the value that asks for nothing."""
    return value is None or value is False or value == [] or value == {}


def _no_tool(value: Any) -> bool:
    return _off(value) or value == "none"


def _text_only(value: Any) -> bool:
    return _off(value) or value == ["text"]


def _one_of_n(body: CompletionBody) -> Callable[[Any], bool]:
    return lambda value: value is None or value == 1 or value == (body.n or 1)


_CHAT_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "tools": (_off, "tools (function calling) are not supported"),
    "functions": (_off, "functions (function calling) are not supported"),
    "tool_choice": (_no_tool, "tool_choice other than 'none' is not supported"),
    "function_call": (_no_tool, "function_call other than 'none' is not supported"),
    "modalities": (_text_only, "modalities other than ['text'] are not supported"),
    "audio": (_off, "audio output is not supported"),
    "prediction": (_off, "predicted outputs are not supported"),
    "reasoning_effort": (_off, "reasoning_effort is not supported"),
    "web_search_options": (_off, "web search is not supported"),
    "store": (_off, "store=true is not supported: this server keeps no completions"),
    "verbosity": (_off, "verbosity is not supported"),
    "logit_bias": (_off, "logit_bias is not supported"),
}

_COMPLETION_CHECKS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "echo": (_off, "echo=true is not supported"),
    "suffix": (lambda v: v is None or v == "", "suffix (insertion) is not supported"),
    "logit_bias": (_off, "logit_bias is not supported"),
}


def refuse_unsupported(body: ChatBody | CompletionBody) -> None:
    """Raise OpenAIError(400) naming the first parameter set to something exlq cannot do."""
    checks = dict(_CHAT_CHECKS if isinstance(body, ChatBody) else _COMPLETION_CHECKS)
    if isinstance(body, CompletionBody):
        checks["best_of"] = (_one_of_n(body), "best_of other than n is not supported")
    for name, (allowed, message) in checks.items():
        if not allowed(getattr(body, name)):
            raise OpenAIError(400, f"{name}: {message} by this server", param=name)

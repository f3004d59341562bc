"""A worker's per-token alternatives (TokenEvent.logprobs: one TokenChoices per token id,
most likely first) in OpenAI's two shapes: chat's ``{content: [{token, logprob, bytes,
top_logprobs}]}`` and completions' ``{tokens, token_logprobs, top_logprobs, text_offset}``.

The chosen token is found in its position's list by id. An engine that does not list it
(exllamav2 lists the top K alone) gets OpenAI's -9999.0, "very unlikely", and the event's
text for a one-token event, since no other text for the token is known."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from exlq.protocol.models import TokenChoices, TokenEvent, TokenLogprob

UNKNOWN_LOGPROB = -9999.0


@dataclass(frozen=True, slots=True)
class _Position:
    token: str
    logprob: float
    top: list[TokenLogprob]


def _positions(event: TokenEvent, top_count: int) -> list[_Position]:
    positions = []
    choices_list: list[TokenChoices] = event.logprobs or []
    for token_id, choices in zip(event.token_ids, choices_list, strict=False):
        chosen = next((c for c in choices.top if c.token_id == token_id), None)
        if chosen is None:
            text = event.text if len(event.token_ids) == 1 else ""
            chosen = TokenLogprob(token=text, token_id=token_id, logprob=UNKNOWN_LOGPROB)
        # An engine may append the chosen token after the top K: the first K are the top.
        positions.append(_Position(chosen.token, chosen.logprob, choices.top[:top_count]))
    return positions


def _bytes(token: str) -> list[int]:
    return list(token.encode("utf-8", errors="surrogatepass"))


def chat_content(event: TokenEvent, top_count: int) -> list[dict[str, Any]]:
    """The entries of chat's ``logprobs.content`` for one event's tokens."""
    return [
        {
            "token": p.token,
            "logprob": p.logprob,
            "bytes": _bytes(p.token),
            "top_logprobs": [
                {"token": t.token, "logprob": t.logprob, "bytes": _bytes(t.token)} for t in p.top
            ],
        }
        for p in _positions(event, top_count)
    ]


@dataclass
class CompletionLogprobs:
    """Completions' logprobs of one choice; text_offset counts characters of the completion
    from its start (no prompt is echoed)."""

    top_count: int
    offset: int = 0
    tokens: list[str] = field(default_factory=list)
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[dict[str, float]] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)

    def add(self, event: TokenEvent) -> dict[str, Any]:
        """Take one event's tokens; return the logprobs of those tokens alone (a chunk's)."""
        part = CompletionLogprobs(self.top_count, self.offset)
        for p in _positions(event, self.top_count):
            part.tokens.append(p.token)
            part.token_logprobs.append(p.logprob)
            part.top_logprobs.append({t.token: t.logprob for t in p.top})
            part.text_offset.append(part.offset)
            part.offset += len(p.token)
        self.offset += len(event.text)
        self.tokens += part.tokens
        self.token_logprobs += part.token_logprobs
        self.top_logprobs += part.top_logprobs
        self.text_offset += part.text_offset
        return part.body()

    def body(self) -> dict[str, Any]:
        return {
            "tokens": self.tokens,
            "token_logprobs": self.token_logprobs,
            "top_logprobs": self.top_logprobs,
            "text_offset": self.text_offset,
        }

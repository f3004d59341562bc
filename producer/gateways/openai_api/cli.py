"""`exlq gateway openai`."""

from __future__ import annotations


def openai() -> None:
    """Serve OpenAI's HTTP API (models, completions, chat, files, batches) from exlq queues."""
    raise NotImplementedError

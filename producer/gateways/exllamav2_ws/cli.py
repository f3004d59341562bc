"""`exlq gateway websocket`."""

from __future__ import annotations


def websocket() -> None:
    """Serve exllamav2's WebSocket protocol from an exlq queue."""
    raise NotImplementedError

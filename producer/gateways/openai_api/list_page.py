"""One page of a list endpoint (files, batches), in OpenAI's list shape."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ListPage:
    data: list[dict[str, Any]]
    has_more: bool

    def body(self) -> dict[str, Any]:
        """``{"object": "list", "data", "first_id", "last_id", "has_more"}``."""
        return {
            "object": "list",
            "data": self.data,
            "first_id": self.data[0]["id"] if self.data else None,
            "last_id": self.data[-1]["id"] if self.data else None,
            "has_more": self.has_more,
        }

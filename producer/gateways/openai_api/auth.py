"""Optional API keys: a request carries ``Authorization: Bearer <key>``. Keys come from a
file and the environment; none given, no key is asked for. Keys are never logged."""

from __future__ import annotations

import hmac
from pathlib import Path

from fastapi import Request

from exlq.producer.gateways.openai_api.errors import OpenAIError


def load_keys(keys_file: Path | None, keys_env: str | None) -> frozenset[str]:
    """The keys of a file (one per line, blank lines and '#' comments skipped) and of a
    comma-separated list."""
    keys: set[str] = set()
    if keys_file is not None:
        for line in keys_file.read_text().splitlines():
            key = line.split("#", 1)[0].strip()
            if key:
                keys.add(key)
    if keys_env:
        keys.update(k.strip() for k in keys_env.split(",") if k.strip())
    return frozenset(keys)


class ApiKeys:
    """A FastAPI dependency that refuses a request without one of the keys (401)."""

    def __init__(self, keys: frozenset[str]) -> None:
        self._keys = tuple(k.encode() for k in keys)

    @property
    def required(self) -> bool:
        return bool(self._keys)

    def __call__(self, request: Request) -> None:
        if not self._keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, given = header.partition(" ")
        if scheme.lower() != "bearer" or not given:
            raise OpenAIError(
                401,
                "You didn't provide an API key: send it as 'Authorization: Bearer <key>'.",
                code="invalid_api_key",
            )
        candidate = given.strip().encode()
        # Compared with every key in constant time, so timing tells nothing of a key.
        if not any(hmac.compare_digest(candidate, key) for key in self._keys):
            raise OpenAIError(401, "Incorrect API key provided.", code="invalid_api_key")

"""redis_refusals: the lines that say what Redis refused and what to grant."""

from __future__ import annotations

import logging

from exlq.protocol.keys import QueueKeys
from exlq.worker.redis_refusals import (
    permission_refused,
    redis_user,
)

KEYS = QueueKeys("demo")


def _record(message: str, *args: object, level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord("exlq.worker.runner", level, __file__, 1, message, args, None)


def test_the_user_is_the_urls_else_default() -> None:
    assert redis_user("rediss://worker%2Ddemo:secret@host:6380/0") == "worker-demo"
    assert redis_user("redis://:secret@host/0") == "default"
    assert redis_user("redis://host") == "default"


def test_a_refusal_names_user_command_queue_and_what_to_grant() -> None:
    refused = "No permissions to access a key"
    line = permission_refused("worker-demo", KEYS, refused, "XGROUP CREATE")
    assert line.startswith(
        "Redis user 'worker-demo' may not send XGROUP CREATE for queue 'demo' "
        "(No permissions to access a key): give it the worker ACL of docs/SECURITY.md"
    )
    assert "~exlq:{demo}:*" in line and "&exlq:{demo}:cancel" in line and "&exlq:out:*" in line
    named = permission_refused("w", KEYS, "no permissions to run the 'xgroup|create' command")
    assert "may not send XGROUP CREATE for queue 'demo'" in named
    assert "may not send a command" in permission_refused("w", KEYS, "can't run this command")

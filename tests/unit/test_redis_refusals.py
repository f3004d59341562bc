"""redis_refusals: the lines that say what Redis refused and what to grant, and the log
filter that makes a refusal met again and again while serving one error line."""

from __future__ import annotations

import logging

from redis.exceptions import NoPermissionError, ResponseError

from exlq.protocol.keys import QueueKeys
from exlq.worker.redis_refusals import (
    OnceARefusal,
    permission_refused,
    redis_user,
    refusal_of,
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


def test_only_error_replies_that_name_an_acl_refusal_count() -> None:
    command = NoPermissionError("this user has no permissions to run the 'evalsha' command")
    key = NoPermissionError(
        "this user has no permissions to access one of the keys used as arguments"
    )
    piped = NoPermissionError(
        "Command # 1 (HSET exlq:{demo}:workers w1 {...}) of pipeline caused error: "
        "(\"this user has no permissions to run the 'hset' command\",)"
    )
    scripted = ResponseError(
        "ERR The user executing the script can't run this command or subcommand"
    )
    assert refusal_of(command) == "no permissions to run the 'evalsha' command"
    assert refusal_of(key) == "no permissions to access one of the keys used as arguments"
    assert refusal_of(piped) == "no permissions to run the 'hset' command"
    assert refusal_of(scripted) == "can't run this command or subcommand"
    assert refusal_of(ResponseError("WRONGTYPE Operation against a key")) is None
    assert refusal_of("no permissions to run the 'x' command") is None  # words, not a reply


def test_each_refusal_is_one_error_line_and_other_records_pass() -> None:
    once = OnceARefusal("worker-demo", KEYS)
    refused = NoPermissionError("this user has no permissions to run the 'xreadgroup' command")
    first = _record("reading from Redis failed (%s); retrying in %.1fs", refused, 0.1)
    assert once.filter(first)
    assert first.levelno == logging.ERROR and first.levelname == "ERROR"
    line = first.getMessage()
    assert line.startswith("reading from Redis failed (this user has no permissions")
    assert "Redis user 'worker-demo' may not send XREADGROUP for queue 'demo'" in line
    assert "not logged again" in line
    assert not once.filter(_record("reading from Redis failed (%s); retrying", refused))
    other = NoPermissionError("this user has no permissions to run the 'xack' command")
    assert once.filter(_record("writing to Redis failed (%s)", other))
    plain = _record("reading from Redis failed (%s)", ConnectionError("gone"))
    assert once.filter(plain) and plain.levelno == logging.WARNING
    assert once.filter(_record("no arguments at all"))

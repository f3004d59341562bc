"""What the worker says when Redis refuses it: its credentials, or a command its ACL lacks.

Either is configuration, not an outage: a retry cannot mend it, and an operator needs one
line that says what to change. At start-up a refusal stops the worker (exit 2, before the
engine loads); while serving, the retries go on (an ACL may be mended live), and the first
refusal of each kind is logged once as an error, the rest not at all.
"""

from __future__ import annotations

import logging
import re
from urllib.parse import unquote, urlsplit

from redis.exceptions import (
    AuthenticationError,
    AuthenticationWrongNumberOfArgsError,
    ResponseError,
)

from exlq.protocol.keys import QueueKeys

# Refusals of the credentials themselves (a wrong password, an unknown or disabled user,
# none given where one is needed), as redis-py names them.
CREDENTIALS_REFUSED = (AuthenticationError, AuthenticationWrongNumberOfArgsError)
ACL_DOC = "docs/SECURITY.md, 'ACL users'"
# Redis's own words for what its ACL refused, the part that stays the same from one refusal
# of a kind to the next (a pipeline's error also quotes the command's arguments, which
# change); the last is a script's call refused on Redis 7.0.
_REFUSAL = re.compile(
    r"no permissions? to (?:run the '[^']+' command|access [a-z ]+)"
    r"|can't run this command or subcommand",
    re.IGNORECASE,
)


def redis_user(url: str) -> str:
    """The ACL user a URL logs in as: its user name, else Redis's ``default``."""
    return unquote(urlsplit(url).username or "") or "default"


def credentials_refused(where: str, exc: Exception) -> str:
    return (
        f"Redis at {where} refused the credentials ({exc or type(exc).__name__}): check the "
        "user name and password in --redis-url / EXLQ_REDIS_URL"
    )


def permission_refused(user: str, keys: QueueKeys, refused: str, command: str | None = None) -> str:
    """The line that says which user was refused what (``refused``: Redis's words; the
    command sent, where Redis's words do not name it), on which queue, and what to grant."""
    return (
        f"Redis user {user!r} may not send {command or _command_in(refused)} for queue "
        f"{keys.queue!r} ({refused}): give it the worker ACL of {ACL_DOC}: its commands, "
        f"the keys ~{keys.base}*, the channel &{keys.cancel}, and PUBLISH to "
        f"&{keys.prefix}:out:*"
    )


def refusal_of(reply: object) -> str | None:
    """What Redis's ACL refused, where ``reply`` is an error reply that says so, else None."""
    return refusal_in(str(reply)) if isinstance(reply, ResponseError) else None


def refusal_in(message: str) -> str | None:
    """What Redis's ACL refused, where an error message from Redis says so, else None."""
    found = _REFUSAL.search(message)
    return found.group(0) if found else None


class OnceARefusal(logging.Filter):
    """On a log handler: a record that reports an ACL refusal (the exception among its
    arguments) becomes one error line that says what to grant, the first time that refusal
    comes; later records of the same refusal are dropped. The worker's retry loops each log
    what failed, a line per retry, and their code needs no knowledge of ACLs."""

    def __init__(self, user: str, keys: QueueKeys) -> None:
        super().__init__()
        self.user = user
        self.keys = keys
        self._seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args if isinstance(record.args, tuple) else ()
        refused = next(filter(None, map(refusal_of, args)), None)
        if refused is None:
            return True
        if refused in self._seen:
            return False
        self._seen.add(refused)
        what = record.getMessage()
        record.msg = "%s. %s (the worker retries; this refusal is not logged again)"
        record.args = (what, permission_refused(self.user, self.keys, refused))
        record.levelno, record.levelname = logging.ERROR, logging.getLevelName(logging.ERROR)
        return True


def _command_in(refused: str) -> str:
    """The command a refusal names (``'xgroup|create'``: XGROUP CREATE), else "a command"."""
    named = re.search(r"'([^']+)' command", refused)
    return named.group(1).replace("|", " ").upper() if named else "a command"

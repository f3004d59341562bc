"""What the worker says when Redis refuses it: its credentials, or a command its ACL lacks.

Either is configuration, not an outage: a retry cannot mend it, and an operator needs one
line that says what to change. At start-up a refusal stops the worker (exit 2, before the
engine loads).
"""

from __future__ import annotations

import re
from urllib.parse import unquote, urlsplit

from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError

from exlq.protocol.keys import QueueKeys

# Refusals of the credentials themselves (a wrong password, an unknown or disabled user,
# none given where one is needed), as redis-py names them.
CREDENTIALS_REFUSED = (AuthenticationError, AuthenticationWrongNumberOfArgsError)
ACL_DOC = "docs/SECURITY.md, 'ACL users'"


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


def _command_in(refused: str) -> str:
    """The command a refusal names (``'xgroup|create'``: XGROUP CREATE), else "a command"."""
    named = re.search(r"'([^']+)' command", refused)
    return named.group(1).replace("|", " ").upper() if named else "a command"

"""Redis credentials given apart from the URL: EXLQ_REDIS_PASSWORD and EXLQ_REDIS_USERNAME.

A password inside a redis:// URL must be percent-encoded (@ : / % ...), while KEDA's
TriggerAuthentication takes it raw; one Kubernetes Secret cannot be both. Given apart, the
password reaches redis-py as it is, and overrides one in the URL.
"""

from __future__ import annotations

from typing import Any, Protocol

from pydantic import SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict


class _Pool(Protocol):
    """What redis-py's connection pools (sync and asyncio) have: the arguments each new
    connection is made with."""

    connection_kwargs: dict[str, Any]


class RedisCredentials(BaseSettings):
    """The username and password (EXLQ_REDIS_USERNAME, EXLQ_REDIS_PASSWORD); either may be
    absent, and then the URL's (if any) counts."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_REDIS_", extra="ignore", frozen=True)

    username: str | None = None
    password: SecretStr | None = None

    def apply_to(self, pool: _Pool) -> None:
        """Make ``pool``'s future connections log in with these. Before the pool's first
        connection: one made earlier keeps what it logged in with."""
        use_credentials(pool, self.username, self.password)


def use_credentials(pool: _Pool, username: str | None, password: SecretStr | None) -> None:
    """What was given overrides the URL's. redis-py's from_url lets the URL's userinfo win
    over keyword arguments, so the pool's connection arguments are set after it is made."""
    if username:
        pool.connection_kwargs["username"] = username
    if password is not None and password.get_secret_value():
        pool.connection_kwargs["password"] = password.get_secret_value()

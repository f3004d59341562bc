"""The OpenAI gateway's settings, from flags and EXLQ_* variables (a flag wins)."""

from __future__ import annotations

from pathlib import Path

from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from exlq.logs import LogFormat
from exlq.protocol.keys import DEFAULT_PREFIX
from exlq.protocol.redis_credentials import RedisCredentials


class GatewaySettings(BaseSettings):
    """Where the gateway listens, which Redis it uses, and who may call it."""

    model_config = SettingsConfigDict(env_prefix="EXLQ_", extra="forbid", frozen=True)

    redis_url: str = "redis://localhost:6379/0"
    redis_username: str | None = Field(None, description="Redis ACL user; overrides the URL's")
    redis_password: SecretStr | None = Field(
        None, description="Redis password, as it is (no percent-encoding); overrides the URL's"
    )
    prefix: str = DEFAULT_PREFIX
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    api_keys_file: Path | None = Field(
        None, description="a file of API keys, one per line ('#' starts a comment)"
    )
    api_keys: str | None = Field(
        None, description="API keys, separated by commas; with neither, no key is asked for"
    )
    worker_stale_after_s: float = Field(
        30.0, gt=0, description="a worker silent this long no longer counts as serving"
    )
    max_backlog: int = Field(
        0, ge=0, description="jobs a lane of a queue may hold before requests get 429; 0: none"
    )
    max_in_flight: int = Field(
        0,
        ge=0,
        description="API requests (streams included) one process serves at once; past it, "
        "503 gateway_overloaded at once; 0: no bound",
    )
    grace_seconds: float = Field(
        30.0,
        ge=0,
        description="on SIGTERM, the time open streams and answers get to finish, while "
        "new connections are refused",
    )
    log_level: str = "INFO"
    log_format: LogFormat = Field("text", description="text lines, or one JSON object a line")

    @property
    def redis_credentials(self) -> RedisCredentials:
        return RedisCredentials(username=self.redis_username, password=self.redis_password)

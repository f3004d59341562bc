"""EXLQ_REDIS_PASSWORD reaches redis-py exactly as written, whatever characters it holds,
and wins over a password in the URL: for the worker, the SDK (and its CLI) and both
gateways. It is a secret: no repr or log line shows it."""

from __future__ import annotations

from typing import Any

import pytest
from redis.asyncio import BlockingConnectionPool

from exlq.producer.client import AsyncProducer
from exlq.producer.gateways.exllamav2_ws.server import WebSocketSettings
from exlq.producer.gateways.openai_api.producers import ProducerPool
from exlq.producer.gateways.openai_api.settings import GatewaySettings
from exlq.protocol.redis_credentials import RedisCredentials, use_credentials
from exlq.worker.settings import BrokerSettings

# Every character a redis:// URL reserves, and a space.
PASSWORD = "p@ss:w/rd%?#[] &+="
URL = "redis://:url-password@127.0.0.1:6379/0"


@pytest.fixture
def password_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("EXLQ_REDIS_PASSWORD", PASSWORD)
    monkeypatch.setenv("EXLQ_REDIS_USERNAME", "exlq-worker")


def _login(pool: Any) -> tuple[Any, Any]:
    kwargs = pool.connection_kwargs
    return kwargs.get("username"), kwargs.get("password")


@pytest.mark.usefixtures("password_env")
async def test_the_worker_logs_in_with_the_password_as_written() -> None:
    broker = BrokerSettings(redis_url=URL)
    pool = BlockingConnectionPool.from_url(broker.redis_url)
    use_credentials(pool, broker.redis_username, broker.redis_password)
    assert _login(pool) == ("exlq-worker", PASSWORD)
    await pool.aclose()


@pytest.mark.usefixtures("password_env")
async def test_the_sdk_logs_in_with_the_password_as_written() -> None:
    producer = AsyncProducer(URL, queue="q", credentials=RedisCredentials())
    try:
        assert _login(producer._redis.connection_pool) == ("exlq-worker", PASSWORD)
    finally:
        await producer.close()


@pytest.mark.usefixtures("password_env")
async def test_the_openai_gateway_logs_in_with_the_password_as_written() -> None:
    settings = GatewaySettings(redis_url=URL)
    pool = ProducerPool(
        settings.redis_url,
        prefix="exlq",
        worker_stale_after_s=30,
        credentials=settings.redis_credentials,
    )
    try:
        assert _login(pool.redis.connection_pool) == ("exlq-worker", PASSWORD)
    finally:
        await pool.redis.aclose()


@pytest.mark.usefixtures("password_env")
def test_the_websocket_gateway_reads_the_password() -> None:
    settings = WebSocketSettings(queue="q", redis_url=URL)
    secret = settings.redis_credentials.password
    assert secret is not None and secret.get_secret_value() == PASSWORD


async def test_without_the_variables_the_urls_login_counts(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("EXLQ_REDIS_PASSWORD", "")  # an empty Secret: no password
    monkeypatch.delenv("EXLQ_REDIS_USERNAME", raising=False)
    pool = BlockingConnectionPool.from_url(URL)
    RedisCredentials().apply_to(pool)
    assert _login(pool) == (None, "url-password")
    await pool.aclose()


@pytest.mark.usefixtures("password_env")
def test_the_password_is_never_shown() -> None:
    shown = [
        repr(BrokerSettings()),
        str(BrokerSettings().model_dump()),
        repr(GatewaySettings()),
        repr(RedisCredentials()),
        repr(WebSocketSettings(queue="q")),
    ]
    for text in shown:
        assert PASSWORD not in text and "**********" in text

"""The `exlq worker` process: connect, load the engine, serve, stop cleanly on a signal."""

from __future__ import annotations

import asyncio
import logging
import signal
from importlib.metadata import PackageNotFoundError, version
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import RedisError

from exlq.protocol.keys import QueueKeys
from exlq.worker.broker import Broker
from exlq.worker.engine_loop import EngineLoop, EngineRunner
from exlq.worker.engine_process import EngineProcess
from exlq.worker.engines import EngineUnavailable, build_engine
from exlq.worker.gc_pauses import freeze_startup_heap
from exlq.worker.http_server import HealthServer
from exlq.worker.metrics import Metrics
from exlq.worker.runner import Worker
from exlq.worker.settings import WorkerSettings

log = logging.getLogger("exlq.worker")

EXIT_CONFIG = 2


class StartupError(RuntimeError):
    """The worker cannot start; the message says what to fix."""


def redacted(url: str) -> str:
    """The URL without its password, for logs and error messages."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.replace(f":{parts.password}@", ":***@")
    return urlunsplit(parts._replace(netloc=netloc))


def package_version() -> str:
    try:
        return version("exlq")
    except PackageNotFoundError:
        return "unknown"


def run_worker(settings: WorkerSettings) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    logging.basicConfig(
        level=settings.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        return asyncio.run(serve(settings))
    except StartupError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG


async def serve(settings: WorkerSettings) -> int:
    keys = QueueKeys(queue=settings.queue_name, prefix=settings.prefix)
    broker = Broker.from_url(
        settings.redis_url,
        keys,
        settings.consumer_name,
        result_ttl_s=settings.result_ttl_seconds,
        dead_max_len=settings.dead_stream_max_len,
    )
    try:
        await _check_redis(broker, settings.redis_url)
        try:
            engine = await asyncio.to_thread(load_engine, settings)
        except EngineUnavailable as exc:
            raise StartupError(str(exc)) from None
        try:
            return await _serve_with(settings, engine, broker)
        finally:
            engine.close()
    finally:
        await broker.close()


def load_engine(settings: WorkerSettings) -> EngineRunner:
    """The engine, loaded, on the runner the settings ask for."""
    if settings.engine_runner == "process":
        process = EngineProcess(settings)
        process.load()
        return process
    return EngineLoop.for_settings(build_engine(settings), settings)


async def _check_redis(broker: Broker, url: str) -> None:
    try:
        await asyncio.wait_for(broker.ping(), 5.0)
    except (RedisError, OSError, TimeoutError) as exc:
        raise StartupError(
            f"cannot reach Redis at {redacted(url)} ({exc or type(exc).__name__}); start Redis "
            "or point --redis-url / EXLQ_REDIS_URL at it"
        ) from None


async def _serve_with(settings: WorkerSettings, engine: EngineRunner, broker: Broker) -> int:
    metrics = Metrics(settings.queue_name)
    metrics.info(
        package_version(),
        engine.name,
        settings.model.name if settings.model else "",
        engine.setup,
    )
    worker = Worker(settings, engine, broker, metrics)
    try:
        http = HealthServer(
            settings.metrics_host, settings.metrics_port, metrics.wsgi_app(), lambda: worker.ready
        )
    except OSError as exc:
        raise StartupError(
            f"cannot serve metrics on {settings.metrics_host}:{settings.metrics_port} ({exc}); "
            "choose another --metrics-port"
        ) from None
    http.start()
    log.info("metrics on http://%s:%d/metrics", settings.metrics_host, http.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    freeze_startup_heap()  # what start-up made stays: no full collection walks it again
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, stop, signum)
    try:
        return await worker.run(stop)
    finally:
        http.stop()


def _on_signal(stop: asyncio.Event, signum: int) -> None:
    log.info("received %s: finishing running jobs, taking no new ones", signal.Signals(signum).name)
    stop.set()

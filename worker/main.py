"""The `exlq worker` process: connect, load the engine, serve, stop cleanly on a signal."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from urllib.parse import urlsplit, urlunsplit

from redis.exceptions import NoPermissionError, RedisError

from exlq._version import __version__
from exlq.logs import configure_logging
from exlq.protocol.keys import QueueKeys
from exlq.protocol.redis_credentials import use_credentials
from exlq.worker import tracing
from exlq.worker.broker import Broker
from exlq.worker.engine_loop import EngineLoop, EngineRunner
from exlq.worker.engine_process import EngineProcess
from exlq.worker.engines import EngineUnavailable, build_engine
from exlq.worker.gc_pauses import freeze_startup_heap
from exlq.worker.http_server import HealthServer
from exlq.worker.metrics import Metrics
from exlq.worker.partitions import with_partitions
from exlq.worker.redis_refusals import (
    CREDENTIALS_REFUSED,
    OnceARefusal,
    credentials_refused,
    permission_refused,
    redis_user,
)
from exlq.worker.runner import Worker
from exlq.worker.settings import WorkerSettings

log = logging.getLogger(__name__)

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


def run_worker(settings: WorkerSettings) -> int:
    """Run until SIGTERM or SIGINT; returns the process exit code."""
    configure_logging(settings.serving.log_level, settings.serving.log_format)
    tracing.trace_to_file(settings.serving.trace_file)  # the engine process starts its own
    try:
        with _refusals_logged_once(settings):
            return asyncio.run(serve(settings))
    except StartupError as exc:
        log.error("%s", exc)
        return EXIT_CONFIG


@contextlib.contextmanager
def _refusals_logged_once(settings: WorkerSettings) -> Iterator[None]:
    """While serving, an ACL refusal is one error line that says what to grant, not a
    warning per retry (redis_refusals.OnceARefusal, on the log's handlers)."""
    keys = QueueKeys(queue=settings.queue_name, prefix=settings.broker.prefix)
    refusals = OnceARefusal(redis_user(settings.broker.redis_url), keys)
    handlers = logging.getLogger().handlers
    for handler in handlers:
        handler.addFilter(refusals)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(refusals)


async def serve(settings: WorkerSettings) -> int:
    redis = settings.broker
    keys = QueueKeys(queue=settings.queue_name, prefix=redis.prefix)
    broker = Broker.from_url(
        redis.redis_url,
        keys,
        redis.consumer_name,
        result_ttl_s=redis.result_ttl_seconds,
        dead_max_len=redis.dead_stream_max_len,
        max_entry_bytes=settings.limits.max_request_bytes,
    )
    use_credentials(broker.client.connection_pool, redis.redis_username, redis.redis_password)
    try:
        await _check_redis(broker, redis.redis_url)
        await _check_access(broker, redis.redis_url)
        broker = await with_partitions(broker, redis.partitions)
        try:
            async with _heartbeats_while_loading(settings, broker):
                engine = await asyncio.to_thread(load_engine, settings)
        except EngineUnavailable as exc:
            raise StartupError(str(exc)) from None
        try:
            return await _serve_with(settings, engine, broker)
        finally:
            engine.close()
    finally:
        await broker.close()


@contextlib.asynccontextmanager
async def _heartbeats_while_loading(
    settings: WorkerSettings, broker: Broker
) -> AsyncIterator[None]:
    """A model can take minutes to load: heartbeats say meanwhile that a worker (not ready
    yet) serves the queue, so producers wait for it instead of hearing there is none. On a
    failed load the heartbeat is taken back."""
    info = {
        "engine": settings.serving.engine,
        "model": settings.serving.model.name if settings.serving.model else None,
        "capacity": 0,
        "load": 0,
        "ready": False,
    }
    every_s = settings.broker.heartbeat_seconds

    async def beat() -> None:
        while True:
            with contextlib.suppress(RedisError, OSError):
                await broker.heartbeat(info, stale_after_s=every_s * 6)
            await asyncio.sleep(every_s)

    task = asyncio.create_task(beat(), name="exlq-loading-heartbeat")
    loaded = False
    try:
        yield
        loaded = True
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        if not loaded:
            with contextlib.suppress(RedisError, OSError):
                await broker.leave()


def load_engine(settings: WorkerSettings) -> EngineRunner:
    """The engine, loaded, on the runner the settings ask for."""
    if settings.serving.engine_runner == "process":
        process = EngineProcess(settings)
        process.load()
        return process
    return EngineLoop(build_engine(settings.serving.engine, settings.load_request()))


async def _check_redis(broker: Broker, url: str) -> None:
    try:
        await asyncio.wait_for(broker.ping(), 5.0)
    except CREDENTIALS_REFUSED as exc:  # first: to redis-py they are connection errors
        raise StartupError(credentials_refused(redacted(url), exc)) from None
    except NoPermissionError as exc:
        raise StartupError(
            permission_refused(redis_user(url), broker.keys, str(exc), "PING")
        ) from None
    except (RedisError, OSError, TimeoutError) as exc:
        raise StartupError(
            f"cannot reach Redis at {redacted(url)} ({exc or type(exc).__name__}); start Redis "
            "or point --redis-url / EXLQ_REDIS_URL at it"
        ) from None


async def _check_access(broker: Broker, url: str) -> None:
    """What serving starts with, sent before the engine loads (a model takes minutes to
    load): a user whose ACL refuses the queue stops the worker now, in one line. The
    consumer group is made here; the worker's own call at the start of serving finds it."""
    sends: list[tuple[str, Callable[[], Awaitable[object]]]] = [
        ("TIME", broker.clock_offset_s),
        ("XGROUP CREATE", broker.ensure_group),
    ]
    for command, send in sends:
        try:
            await send()
        except NoPermissionError as exc:
            raise StartupError(
                permission_refused(redis_user(url), broker.keys, str(exc), command)
            ) from None
        except (RedisError, OSError) as exc:
            raise StartupError(
                f"Redis at {redacted(url)} failed {command} for queue {broker.keys.queue!r} "
                f"({exc or type(exc).__name__})"
            ) from None


async def _serve_with(settings: WorkerSettings, engine: EngineRunner, broker: Broker) -> int:
    model = settings.serving.model
    metrics = Metrics(settings.queue_name, model.name if model else "")
    metrics.info(__version__, engine.name, engine.info)
    worker = Worker(settings, engine, broker, metrics)
    host, port = settings.serving.metrics_host, settings.serving.metrics_port
    try:
        http = HealthServer(host, port, metrics.wsgi_app(), lambda: worker.ready)
    except OSError as exc:
        raise StartupError(
            f"cannot serve metrics on {host}:{port} ({exc}); choose another --metrics-port"
        ) from None
    http.start()
    log.info("metrics on http://%s:%d/metrics", host, http.port)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    freeze_startup_heap()  # what start-up made stays: no full collection walks it again
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, _on_signal, stop, signum)
    try:
        return await worker.run(stop)
    except NoPermissionError as exc:  # the ACL changed since the start-up checks
        user = redis_user(settings.broker.redis_url)
        raise StartupError(permission_refused(user, broker.keys, str(exc))) from None
    finally:
        http.stop()
        if worker.broker is not broker:  # partitions joined while it served
            await worker.broker.close()


def _on_signal(stop: asyncio.Event, signum: int) -> None:
    log.info("received %s: finishing running jobs, taking no new ones", signal.Signals(signum).name)
    stop.set()

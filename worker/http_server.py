"""The worker's HTTP endpoints: /metrics, /healthz and /readyz, on a thread of their own."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from exlq.worker.metrics import WsgiApp


class _ThreadingWSGIServer(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _QuietHandler(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class HealthServer:
    """Serves metrics and the probes. ``is_ready`` is read on every /readyz request."""

    def __init__(
        self, host: str, port: int, metrics_app: WsgiApp, is_ready: Callable[[], bool]
    ) -> None:
        self._metrics_app = metrics_app
        self._is_ready = is_ready
        self._server = make_server(
            host, port, self._app, server_class=_ThreadingWSGIServer, handler_class=_QuietHandler
        )
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="exlq-http", daemon=True
        )

    @property
    def port(self) -> int:
        return int(self._server.server_port)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _app(self, environ: dict[str, Any], start: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path == "/metrics":
            return self._metrics_app(environ, start)
        if path == "/healthz":
            return _text(start, "200 OK", "ok\n")
        if path == "/readyz":
            if self._is_ready():
                return _text(start, "200 OK", "ready\n")
            return _text(start, "503 Service Unavailable", "not ready\n")
        return _text(start, "404 Not Found", "not found: try /metrics, /healthz or /readyz\n")


def _text(start: Callable[..., Any], status: str, body: str) -> list[bytes]:
    data = body.encode()
    start(
        status, [("Content-Type", "text/plain; charset=utf-8"), ("Content-Length", str(len(data)))]
    )
    return [data]

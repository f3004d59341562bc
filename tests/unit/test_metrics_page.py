"""The /metrics page, as prometheus-client writes it on any version in exlq's range:
every per-queue series, in the text format Prometheus scrapes."""

from __future__ import annotations

import io
from typing import Any

from exlq.worker.metrics import Metrics
from tests.unit.test_metrics import PER_QUEUE


def _get(app: Any, path: str) -> tuple[str, str]:
    started: list[str] = []

    def start_response(status: str, headers: list[tuple[str, str]], *exc: Any) -> None:
        started.append(status)

    environ = {
        "REQUEST_METHOD": "GET",
        "PATH_INFO": path,
        "QUERY_STRING": "",
        "SERVER_NAME": "127.0.0.1",
        "SERVER_PORT": "9400",
        "SERVER_PROTOCOL": "HTTP/1.1",
        "wsgi.input": io.BytesIO(),
        "wsgi.url_scheme": "http",
    }
    body = b"".join(app(environ, start_response))
    return started[0], body.decode()


def test_the_metrics_page_shows_every_per_queue_series() -> None:
    metrics = Metrics("q1")
    metrics.add_generated_tokens(3)
    status, page = _get(metrics.wsgi_app(), "/metrics")
    assert status.startswith("200")
    for name in PER_QUEUE:
        assert f'{name}{{queue="q1"}} ' in page, name
    assert 'exlq_generated_tokens_total{queue="q1"} 3.0' in page

"""A bound on the API requests one gateway process serves at once.

One process on two cores held 2,000 open streams; 3,000 opened at once saturated its event
loop, and requests then failed after the SDK's reply timeout with a misleading "Redis
unavailable" (docs/PERFORMANCE.md). With ``max_in_flight`` set, a request past the bound is
answered at once with 503 ``gateway_overloaded`` and a Retry-After, in OpenAI's shape, so
clients back off and a load balancer can send them to another replica. Health probes are
never counted or refused."""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

from exlq.producer.gateways.openai_api.errors import error_body

RETRY_AFTER_S = 1


class InFlightLimit:
    """ASGI middleware: at most ``limit`` requests under /v1 at once."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit
        self.in_flight = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not str(scope.get("path", "")).startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        if self.in_flight >= self.limit:
            await _overloaded(send, self.limit)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def _overloaded(send: Send, limit: int) -> None:
    message = (
        f"This gateway is serving its limit of {limit} requests at once: retry shortly, or "
        "through another replica."
    )
    body = json.dumps(error_body(503, message, code="gateway_overloaded")).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", str(RETRY_AFTER_S).encode()),
    ]
    await send({"type": "http.response.start", "status": 503, "headers": headers})
    await send({"type": "http.response.body", "body": body})

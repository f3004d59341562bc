"""Errors in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}`` with the
HTTP status OpenAI's clients map to their own exception types."""

from __future__ import annotations

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

# The error type OpenAI's API sends with each status.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
}


class OpenAIError(Exception):
    """An error a route raises; the app's handler answers it in OpenAI's shape."""

    def __init__(
        self, status: int, message: str, *, code: str | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def body(self) -> dict[str, dict[str, str | None]]:
        return error_body(self.status, self.message, code=self.code, param=self.param)


def error_body(
    status: int, message: str, *, code: str | None = None, param: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


async def openai_error_response(request: Request, exc: Exception) -> JSONResponse:
    """The exception handler for OpenAIError."""
    assert isinstance(exc, OpenAIError)
    return JSONResponse(exc.body(), status_code=exc.status)


async def validation_error_response(request: Request, exc: Exception) -> JSONResponse:
    """FastAPI's own body validation, answered as OpenAI answers a bad parameter: 400."""
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {}
    where = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(where) or None
    message = f"{param}: {first.get('msg', 'invalid value')}" if param else "invalid request body"
    return JSONResponse(error_body(400, message, param=param), status_code=400)

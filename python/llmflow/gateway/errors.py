"""OpenAI-style errors: one exception type, one body shape, the right status for each case.

Every error the gateway answers is `{"error": {"message", "type", "code"}}` (plus `param` when a
field is to blame), the shape the `openai` client turns into its typed exceptions, and the
`x-llmflow-reason` header carries the same code for proxies that read headers only (the status
contract, `contract.py`). That holds for a bug too: an exception no handler expected is logged
with its traceback and answered as an OpenAI-style 500, never as a plain-text page.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from llmflow.gateway.contract import REASON_HEADER

if TYPE_CHECKING:
    from fastapi import FastAPI
    from starlette.requests import Request

__all__ = ["GatewayError", "error_body", "error_bytes", "install_handlers"]

_TYPES = {  # status -> OpenAI error type
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    499: "client_closed_request",
    502: "bad_gateway",
    503: "service_unavailable",
    504: "timeout_error",
}


class GatewayError(Exception):
    """An error to answer the client with, as an OpenAI-style body.

    Args:
        status: HTTP status code.
        message: human-readable explanation.
        code: machine-readable reason (`queue_full`, `context_length_exceeded`, ...).
        param: the request field to blame, if any.
        headers: extra response headers (`Retry-After`, `WWW-Authenticate`).
        upstream: the backend's own error object, when vLLM refused the request (its 4xx):
            the body is that object as vLLM wrote it (`message`, `type`, `param`, `code`),
            so the client hears its mistake as it would from vLLM directly.
    """

    def __init__(
        self,
        status: int,
        message: str,
        code: str,
        *,
        param: str | None = None,
        headers: dict[str, str] | None = None,
        upstream: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.headers = headers or {}
        self.upstream = upstream

    @property
    def body(self) -> dict[str, Any]:
        """The JSON body: `{"error": {...}}`."""
        if self.upstream is not None:
            return {"error": self.upstream}
        return error_body(self.status, self.message, self.code, self.param)

    @property
    def wire_headers(self) -> dict[str, str]:
        """Its headers as they go out: its own, and the reason (`x-llmflow-reason`)."""
        return {**self.headers, REASON_HEADER: self.code}

    def response(self) -> JSONResponse:
        """This error as a response."""
        return JSONResponse(self.body, status_code=self.status, headers=self.wire_headers)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict[str, Any]:
    """Build the OpenAI error object for a status.

    Args:
        status: HTTP status, which picks the error `type`.
        message: human-readable explanation.
        code: machine-readable reason.
        param: the request field to blame, if any.

    Returns:
        `{"error": {"message", "type", "code", "param"}}`.
    """
    kind = _TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "code": code, "param": param}}


def error_bytes(status: int, message: str, code: str) -> bytes:
    """An error body as the bytes of a JSON document, for code below the ASGI app."""
    return json.dumps(error_body(status, message, code)).encode()


async def _on_gateway_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, GatewayError)
    return exc.response()


async def _on_validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    first = exc.errors()[0] if exc.errors() else {"msg": "invalid request", "loc": ()}
    param = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or None
    return GatewayError(
        400, f"{param or 'request'}: {first['msg']}", "invalid_request", param=param
    ).response()


async def _on_http_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    codes = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}
    error = GatewayError(
        exc.status_code,
        str(exc.detail),
        codes.get(exc.status_code, "error"),
        headers=dict(exc.headers or {}),
    )
    return error.response()


async def _on_unexpected(_request: Request, _exc: Exception) -> JSONResponse:
    # Starlette's ServerErrorMiddleware calls this, then re-raises: the server logs the
    # traceback. The message names no detail of the bug (it may hold request data).
    return GatewayError(
        500, "the gateway failed on this request; it is logged, please report it", "internal_error"
    ).response()


def install_handlers(app: FastAPI) -> None:
    """Make every error the app raises answer with an OpenAI-style body."""
    app.add_exception_handler(Exception, _on_unexpected)
    app.add_exception_handler(GatewayError, _on_gateway_error)
    app.add_exception_handler(RequestValidationError, _on_validation_error)
    app.add_exception_handler(StarletteHTTPException, _on_http_error)

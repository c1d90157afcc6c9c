"""One-line dependency accessors: the app's runtime objects for a request."""

from __future__ import annotations

from typing import TYPE_CHECKING

from fastapi import Request  # noqa: TC002 - FastAPI resolves dependency signatures at runtime

if TYPE_CHECKING:
    from llmflow.gateway.app import Gateway
    from llmflow.gateway.auth import Identity
    from llmflow.gateway.serving import CompletionService

__all__ = ["admin", "gateway", "identity", "service"]


def gateway(request: Request) -> Gateway:
    """The running gateway."""
    return request.app.state.gateway  # type: ignore[no-any-return]


def service(request: Request) -> CompletionService:
    """The completion service."""
    return request.app.state.gateway.service  # type: ignore[no-any-return]


def identity(request: Request) -> Identity:
    """Who is calling, from the API key alone (401 when keys are configured and it is bad)."""
    return gateway(request).keyring.authenticate(request.headers.get("authorization"))


def admin(request: Request) -> None:
    """Let an admin request through (401 when `admin.api_key` is set and not presented)."""
    gateway(request).admin_guard.check(request.headers.get("authorization"))

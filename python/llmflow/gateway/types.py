"""Type aliases shared across the gateway."""

from __future__ import annotations

from typing import Any, Literal

from starlette.types import ASGIApp, Message, Receive, Scope, Send

__all__ = [
    "ASGIApp",
    "Endpoint",
    "Json",
    "Message",
    "Outcome",
    "Receive",
    "Scope",
    "Send",
]

Json = dict[str, Any]
"""A parsed JSON object (an OpenAI request body or chunk)."""

Endpoint = Literal["chat", "completions", "responses"]
"""Which OpenAI endpoint a request came in on."""

Outcome = Literal["completed", "error", "timeout", "cancelled"]
"""How a governed request ended, in the core's words."""

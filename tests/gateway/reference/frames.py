"""The Python path's SSE framing of a chunk, the reference the relay's frames are held to
(`rust/src/front/reply.rs`'s `frame`)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["encode_event"]


def encode_event(chunk: Any) -> bytes:
    """One SSE frame: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"

"""The Python path's SSE framing of a chunk, the reference the relay's frames are held to
(`rust/src/front/reply.rs`'s `frame`)."""

from __future__ import annotations

import json
from typing import Any

__all__ = ["encode_event", "encode_item"]


def encode_event(chunk: Any) -> bytes:
    """One SSE frame: `data: {json}` and a blank line."""
    return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def encode_item(item: Any) -> bytes:
    """The SSE frame of an item (frames pass through untouched)."""
    return item if isinstance(item, bytes) else encode_event(item)

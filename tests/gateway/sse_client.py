"""A minimal SSE reader for tests that need frame-level timing (the `openai` client hides it)."""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

    import httpx

__all__ = ["frames", "text_of"]


async def frames(response: httpx.Response) -> AsyncIterator[Any]:
    """Each `data:` payload, JSON-decoded; `[DONE]` comes as the string `"[DONE]"`."""
    async for line in response.aiter_lines():
        if line.startswith("data: "):
            payload = line[6:]
            yield payload if payload == "[DONE]" else json.loads(payload)


def text_of(chunks: list[Any]) -> str:
    """The concatenated text of chat or completion chunks."""
    out = []
    for chunk in chunks:
        if not isinstance(chunk, dict):
            continue
        for choice in chunk.get("choices") or ():
            out.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
    return "".join(out)

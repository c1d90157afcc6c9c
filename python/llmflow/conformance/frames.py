"""vLLM's reply shapes for the conformance backend: SSE chunks and the whole answer."""

from __future__ import annotations

import json
import time
from typing import Any

__all__ = ["MODEL", "Frames", "whole"]

MODEL = "conformance"


class Frames:
    """vLLM's SSE frames for one streamed reply."""

    # A role chunk first (chat), one chunk per token (the last with its finish reason and,
    # with `continuous_usage_stats`, every one with the usage so far), a usage-only chunk.

    def __init__(self, body: dict[str, Any], chat: bool, continuous: bool) -> None:
        self.chat, self.continuous = chat, continuous
        self.base = {
            "id": "chatcmpl-conformance" if chat else "cmpl-conformance",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": body.get("model", MODEL),
        }

    def role(self) -> bytes:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""},
                  "logprobs": None, "finish_reason": None}
        return self._frame([choice], 0 if self.continuous else None)

    def token(self, text: str, i: int, n: int) -> bytes:
        choice: dict[str, Any] = (
            {"index": 0, "delta": {"content": text}} if self.chat else {"index": 0, "text": text}
        )
        choice.update(logprobs=None, finish_reason="length" if i == n - 1 else None)
        return self._frame([choice], i + 1 if self.continuous else None)

    def usage(self, n: int) -> bytes:
        return self._frame([], n)

    def _frame(self, choices: list[dict[str, Any]], completion: int | None) -> bytes:
        chunk: dict[str, Any] = {**self.base, "choices": choices}
        if completion is not None:
            chunk["usage"] = _usage(completion)
        return b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n"


def _usage(completion: int) -> dict[str, int]:
    return {"prompt_tokens": 16, "completion_tokens": completion, "total_tokens": 16 + completion}


def whole(body: dict[str, Any], tokens: int, chat: bool, text: str) -> dict[str, Any]:
    """The unstreamed answer: `text` as the one choice's content."""
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
    if chat:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    return {
        "id": "chatcmpl-conformance" if chat else "cmpl-conformance",
        "object": "chat.completion" if chat else "text_completion",
        "created": int(time.time()),
        "model": body.get("model", MODEL),
        "choices": [choice],
        "usage": _usage(tokens),
    }

"""A backend that turns hostile on request: the fake vLLM, but a completion may be answered
with bytes of the test's choosing (an event that never ends, CRLFs split between writes, JSON
of the wrong shape).

`HostileBackend` wraps a `FakeVllm`'s ASGI app (so `/metrics`, health and ordinary replies stay
the fake's). A test sets `script`: called with each completion's JSON body, it returns the
reply's body pieces (an async iterator of bytes, each written and flushed in turn) or None to
let the fake answer. What it sent, it counts itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

__all__ = ["HostileBackend", "chunk_event", "install"]

Script = "Callable[[dict[str, Any]], AsyncIterator[bytes] | None]"


@dataclass
class HostileBackend:
    """ASGI wrapper around a fake's app; see the module docstring."""

    app: Any
    script: Any = None  # Script
    sent_bytes: int = 0
    replies: int = 0
    finished: int = 0  # scripted replies whose generator ran to its end
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)  # of every completion request

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        self.headers.append({k.decode().lower(): v.decode() for k, v in scope["headers"]})
        raw = b""
        while True:
            message = await receive()
            raw += message.get("body", b"")
            if not message.get("more_body"):
                break
        body = json.loads(raw)
        pieces = self.script(body) if self.script is not None else None
        if pieces is None:
            replayed = False

            async def replay() -> Any:
                nonlocal replayed
                if replayed:
                    return await receive()
                replayed = True
                return {"type": "http.request", "body": raw, "more_body": False}

            await self.app(scope, replay, send)
            return
        self.replies += 1
        self.bodies.append(body)
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream")],
            }
        )
        async for piece in pieces:
            self.sent_bytes += len(piece)
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        self.finished += 1


def install(fakes: dict[str, Any]) -> None:
    """`start_gateway(configure=install)`: every fake's app behind a `HostileBackend`."""
    for fake in fakes.values():
        fake.app = HostileBackend(fake.app)


def chunk_event(content: str, chat: bool = True, **extra: Any) -> bytes:
    """One well-formed vLLM stream chunk as an SSE event."""
    choice: dict[str, Any] = (
        {"index": 0, "delta": {"content": content}} if chat else {"index": 0, "text": content}
    )
    choice.update(logprobs=None, finish_reason=None)
    chunk = {
        "id": "chatcmpl-hostile",
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": 1,
        "model": "fake-model",
        "choices": [choice],
        **extra,
    }
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"

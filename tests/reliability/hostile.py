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


class RawBackend:
    """A backend on a bare socket: `/metrics` answers vLLM's gauges; each completion POST is
    counted and answered by `mode`: `ok` (a short chunked SSE stream, kept alive), `swallow`
    (read the request, close without a byte), or raw bytes to send as the whole response."""

    def __init__(self) -> None:
        self.mode: bytes | str = "ok"
        self.posts = 0
        self.connections = 0
        self.server: Any = None
        self.writers: list[Any] = []

    async def start(self) -> str:
        import asyncio

        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        """Stop listening (connections are refused from now on) and drop every connection."""
        self.server.close()
        for writer in self.writers:
            writer.close()

    async def _serve(self, reader: Any, writer: Any) -> None:
        import asyncio

        self.connections += 1
        self.writers.append(writer)
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = 0
                for line in head.split(b"\r\n"):
                    if line.lower().startswith(b"content-length:"):
                        length = int(line.split(b":")[1])
                await reader.readexactly(length)
                if head.startswith(b"GET /metrics"):
                    text = b"vllm:num_requests_running 0.0\nvllm:kv_cache_usage_perc 0.0\n"
                    writer.write(
                        b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n%s" % (len(text), text)
                    )
                    await writer.drain()
                    continue
                self.posts += 1
                if self.mode == "swallow":
                    break
                if isinstance(self.mode, bytes):
                    writer.write(self.mode)
                    await writer.drain()
                    break
                body = chunk_event("ok ") + b"data: [DONE]\n\n"
                writer.write(
                    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                    b"transfer-encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n" % (len(body), body)
                )
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

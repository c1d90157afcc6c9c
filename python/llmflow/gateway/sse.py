"""The SSE response: writes a session's window to the client, paced and watched.

A plain ASGI response (an `EventSourceResponse`, so it documents itself as `text/event-stream`)
that owns its session from the first byte on. It always listens for the client's disconnect,
whatever ASGI spec version the server speaks, and closes the session in `finally`, so a client
that goes away mid-stream aborts the upstream request and frees its slot at once. A client that
stops reading fills the session's window; the runtime's stall timer then cuts it, and the cut
cancels this writer. With `sse_flush_interval` set, chunks that arrive within one interval go
out merged, as valid chunks.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import TYPE_CHECKING

import anyio
from fastapi.sse import EventSourceResponse

from llmflow.gateway.streaming import encode_item, merge_chunks

if TYPE_CHECKING:
    from llmflow.gateway.session import StreamSession
    from llmflow.gateway.streaming import Item
    from llmflow.gateway.types import Receive, Scope, Send

__all__ = ["SessionStream"]

_DONE = b"data: [DONE]\n\n"


class SessionStream(EventSourceResponse):
    """Streams one session to an HTTP client as Server-Sent Events.

    Args:
        session: a session past its first token (or already ended with a tail).
        flush_interval_s: coalescing interval; 0 forwards each chunk as it arrives.
    """

    def __init__(self, session: StreamSession, flush_interval_s: float) -> None:
        super().__init__(
            content=iter(()),
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no", **session.id_header},
        )
        self.session = session
        self.flush_interval_s = flush_interval_s

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        """Run the stream until it ends, the client leaves, or the runtime cuts a stalled one."""
        session = self.session
        try:
            async with anyio.create_task_group() as group:
                session.cancel_writer = group.cancel_scope.cancel
                group.start_soon(_until_disconnect, receive, group.cancel_scope)
                with contextlib.suppress(OSError):  # the client went away while we wrote
                    await self._write(send)
                group.cancel_scope.cancel()
        finally:
            session.cancel_writer = None
            await session.close()

    async def _write(self, send: Send) -> None:
        await send(
            {"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers}
        )
        window, metrics = self.session.window, self.session.ctx.metrics
        last = 0.0
        while chunks := await window.take():
            if self.flush_interval_s > 0:
                wait = last + self.flush_interval_s - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                    chunks += window.take_nowait()
                chunks = merge_chunks(chunks)
            now = time.monotonic()
            if last:
                metrics.inter_chunk.observe(now - last)
            last = now
            await send({"type": "http.response.body", "body": _frames(chunks), "more_body": True})
        await send({"type": "http.response.body", "body": _DONE, "more_body": False})


def _frames(chunks: list[Item]) -> bytes:
    if len(chunks) == 1:
        return encode_item(chunks[0])
    return b"".join(encode_item(c) for c in chunks)


async def _until_disconnect(receive: Receive, scope: anyio.CancelScope) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
    scope.cancel()

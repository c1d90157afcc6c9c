"""What a client received, read from the bytes on the wire (not from the gateway's counters)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

__all__ = ["CHAT", "Received", "chat", "stream_chat"]

CHAT = "/v1/chat/completions"


def chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    """A chat completion body for the fake's model."""
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


@dataclass
class Received:
    """One streamed reply as the client saw it."""

    status: int
    headers: dict[str, str]
    events: list[Any] = field(default_factory=list)  # JSON objects, and "[DONE]"
    raw: bytes = b""

    @property
    def text(self) -> str:
        """The concatenated content of the chunks."""
        out = []
        for event in self.events:
            for choice in (event.get("choices") or ()) if isinstance(event, dict) else ():
                out.append((choice.get("delta") or {}).get("content") or choice.get("text") or "")
        return "".join(out)

    @property
    def error(self) -> dict[str, Any] | None:
        """The in-band error event, if the stream carried one."""
        for event in self.events:
            if isinstance(event, dict) and "error" in event:
                return event["error"]  # type: ignore[no-any-return]
        return None

    @property
    def notice(self) -> dict[str, Any] | None:
        """The gateway's cut marker (`{"truncated": true, "reason": ...}`), if any."""
        for event in self.events:
            if isinstance(event, dict) and "llmflow" in event:
                return event["llmflow"]  # type: ignore[no-any-return]
        return None

    @property
    def done(self) -> bool:
        """True when the stream ended with `[DONE]`."""
        return bool(self.events) and self.events[-1] == "[DONE]"

    def assert_failed_visibly(self) -> None:
        """The stream ended with an error the client cannot take for success."""
        if self.status != 200:
            return  # an error status: no stream at all
        assert self.error is not None, self.events
        after = self.events[self.events.index({"error": self.error}) + 1 :]
        assert after in ([], ["[DONE]"]), after  # the error is the last word


async def stream_chat(client: httpx.AsyncClient, **body: Any) -> Received:
    """POST a streamed chat completion and read it to the end (or to the connection's end)."""
    async with client.stream("POST", CHAT, json=chat(**body)) as r:
        raw = b""
        try:
            async for piece in r.aiter_raw():
                raw += piece
        except Exception as exc:  # a cut connection is an outcome to assert on
            raw += f"\n<<connection broke: {exc!r}>>".encode()
        received = Received(r.status_code, dict(r.headers), raw=raw)
    for block in raw.decode(errors="replace").split("\n\n"):
        block = block.strip()
        if block.startswith("data: "):
            data = block[6:]
            received.events.append(data if data == "[DONE]" else json.loads(data))
        elif r.status_code != 200 and block.startswith("{"):
            received.events.append(json.loads(block))
    return received

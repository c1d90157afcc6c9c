"""SSE de-framing of a vLLM stream on the Python path: bytes in, `data:` payloads out.

The twin of `rust/src/relay/sse.rs` (the relay's), with the same rules and the same bounds:
events end at a blank line (`\\n\\n`, `\\r\\n\\r\\n`, or a `\\r\\n` split between reads), only their
`data:` lines count (several are joined with `\\n`), `[DONE]` ends the stream. An unfinished event
holds at most `max_event` bytes, and each byte is searched for the blank line once: a backend
that never ends its event costs a bounded buffer and linear time, then a `EventTooLarge`.
"""

from __future__ import annotations

__all__ = ["DONE", "EventTooLarge", "SseDecoder"]

DONE = b"[DONE]"
_CR = 13


class EventTooLarge(Exception):
    """An event grew past the limit without ending."""


class SseDecoder:
    """Feed body pieces; get the payloads of the events they complete.

    Args:
        max_event: the largest event accepted, in bytes (`server.max_event_bytes`).
    """

    def __init__(self, max_event: int) -> None:
        self.max_event = max(max_event, 1)
        self.done = False  # `[DONE]` was seen; what follows is ignored
        self._buffer = bytearray()
        self._scanned = 0  # `_buffer[:_scanned]` holds no blank line (its last byte may start one)

    @property
    def pending(self) -> bytes:
        """The bytes of the unfinished event."""
        return bytes(self._buffer)

    def feed(self, piece: bytes) -> list[bytes]:
        """The payloads of the events `piece` completes (none once `[DONE]` was seen).

        Raises:
            EventTooLarge: the unfinished event passed `max_event` bytes (its bytes are dropped).
        """
        if self.done:
            return []
        buf = self._buffer
        start = len(buf)
        buf += piece
        if b"\r" in piece or (start and buf[start - 1] == _CR):
            at = max(start - 1, 0)  # a CRLF split between reads is joined first
            buf[at:] = bytes(buf[at:]).replace(b"\r\n", b"\n")
        out: list[bytes] = []
        taken = 0
        search = max(self._scanned - 2, 0)  # a joined CR shortened the old bytes by one
        while (end := buf.find(b"\n\n", search)) >= 0:
            data = _data_of(bytes(buf[taken:end]))
            taken = search = end + 2
            if data is None:
                continue
            if data == DONE:
                self.done = True
                break
            out.append(data)
        del buf[:taken]
        self._scanned = len(buf)
        if len(buf) > self.max_event and not self.done:
            self._buffer = bytearray()
            raise EventTooLarge(
                f"backend sent an SSE event over {self.max_event} bytes (server.max_event_bytes)"
            )
        return out


def _data_of(block: bytes) -> bytes | None:
    if block.startswith(b"data:") and b"\n" not in block:
        return block[5:].strip(b" \t")
    lines = [line[5:].strip(b" \t") for line in block.split(b"\n") if line.startswith(b"data:")]
    return b"\n".join(lines) if lines else None

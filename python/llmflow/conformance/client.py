"""The suite's clients: what each request got, as a client sees it on the wire.

`Gateway.request` sends one chat completion (streamed or whole) and reads it to its end;
`Gateway.disconnect` reads a stream's first tokens and closes the connection; `Gateway.stall`
sends a streamed request on a socket with a small receive buffer and never reads from it.
Each returns an `Outcome`, which judges itself: one complete response, one error, or broken.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from llmflow.conformance.backend import Plan, plan_text

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

__all__ = ["Gateway", "Outcome", "Stalled", "gateway_base"]

_TOKEN = re.compile(r"\bt\d+x*\b")  # the backend's token words ("t12", padded "t12xxxx")
_CHAT = "/v1/chat/completions"
_STALL_RCVBUF = 4096  # bytes: the stalled client's kernel receive buffer
_ERROR_BODY = 2048  # bytes of an error answer kept for the report


def gateway_base(url: str) -> str:
    """The gateway's base URL without a trailing `/v1` or slash."""
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


@dataclass
class Outcome:
    """What one request got, as its client saw it (times on `time.monotonic()`)."""

    tag: str
    stream: bool
    planned: int  # tokens the backend was asked for
    sent_at: float
    status: int | None = None  # None: no response head
    answered_at: float | None = None  # when the status came
    ended_at: float | None = None
    headers: dict[str, str] = field(default_factory=dict)  # lower-case names
    tokens: int = 0
    done_events: int = 0  # `data: [DONE]` lines
    error_events: int = 0  # in-band `{"error": ...}` events, or an error in a whole answer
    error_codes: list[str] = field(default_factory=list)
    after_end: bool = False  # data after [DONE] or after an error event's end
    failure: str | None = None  # the transport error, if the exchange broke
    body: bytes = b""  # the start of a non-200 answer

    @property
    def wait_s(self) -> float | None:
        """Seconds from sending to the response's status."""
        return None if self.answered_at is None else self.answered_at - self.sent_at

    def verdict(self) -> str:
        """`complete`, `error`, or `broken: why`: how the request ended, once."""
        if self.failure is not None:
            return f"broken: {self.failure}"
        if self.status is None:
            return "broken: no response"
        if self.status != 200:
            return "error"
        if self.after_end:
            return "broken: data after the end of the reply"
        if self.stream and self.done_events != 1:
            return f"broken: {self.done_events} [DONE] events"
        if self.error_events > 1:
            return f"broken: {self.error_events} error events"
        if self.error_events == 1:
            return "error"
        if self.tokens != self.planned:
            return f"broken: {self.tokens} of {self.planned} tokens and no error"
        return "complete"

    def retry_after(self) -> str | None:
        """The Retry-After header, as sent."""
        return self.headers.get("retry-after")


@dataclass
class Stalled:
    """A stalled client: its socket, open until `close`."""

    tag: str
    sent_at: float
    writer: asyncio.StreamWriter

    def close(self) -> None:
        """Close the connection at once."""
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.transport.abort()


class Gateway:
    """An OpenAI-compatible gateway, driven from outside.

    Args:
        url: its base URL (with or without `/v1`).
        model: the model name to ask for.
        api_key: the `Authorization: Bearer` key of ordinary requests (None: none).
        timeout_s: the longest a request may take before it counts as broken.
    """

    def __init__(self, url: str, model: str, api_key: str | None, timeout_s: float) -> None:
        self.base, self.model, self.api_key = gateway_base(url), model, api_key
        self.timeout_s = timeout_s
        self._client = httpx.AsyncClient(
            base_url=self.base,
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )

    async def aclose(self) -> None:
        """Close the pooled connections."""
        await self._client.aclose()

    def body(self, plan: Plan, stream: bool) -> dict[str, Any]:
        """The chat completion request that carries `plan`."""
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": plan_text(plan)}],
            "max_tokens": plan.tokens,
            "stream": stream,
        }

    def headers(self, key: str | None) -> dict[str, str]:
        """Request headers with `key` (default: the ordinary key), if any."""
        key = key or self.api_key
        return {"authorization": f"Bearer {key}"} if key else {}

    async def request(self, plan: Plan, stream: bool = True, key: str | None = None) -> Outcome:
        """Send one request and read its answer to the end."""
        out = Outcome(plan.tag, stream, plan.tokens, time.monotonic())
        try:
            async with self._client.stream(
                "POST", _CHAT, json=self.body(plan, stream), headers=self.headers(key)
            ) as response:
                _head(out, response)
                if response.status_code != 200:
                    out.body = (await response.aread())[:_ERROR_BODY]
                elif stream:
                    async for data in _events(response):
                        _event(out, data)
                else:
                    _whole(out, await response.aread())
        except (httpx.HTTPError, OSError) as exc:
            out.failure = f"{type(exc).__name__}: {exc}"[:200]
        out.ended_at = time.monotonic()
        return out

    async def disconnect(self, plan: Plan, after_tokens: int) -> tuple[Outcome, float | None]:
        """Stream `plan`, close the connection once `after_tokens` arrived; (outcome, when the
        connection was closed, or None if it ended before that)."""
        out = Outcome(plan.tag, True, plan.tokens, time.monotonic())
        closed_at = None
        async with httpx.AsyncClient(base_url=self.base, timeout=self.timeout_s,
                                     trust_env=False) as client:
            try:
                async with client.stream(
                    "POST", _CHAT, json=self.body(plan, True), headers=self.headers(None)
                ) as response:
                    _head(out, response)
                    if response.status_code == 200:
                        async for data in _events(response):
                            _event(out, data)
                            if out.tokens >= after_tokens:
                                closed_at = time.monotonic()
                                break
            except (httpx.HTTPError, OSError) as exc:
                out.failure = f"{type(exc).__name__}: {exc}"[:200]
        out.ended_at = time.monotonic()
        return out, closed_at

    async def stall(self, plan: Plan) -> Stalled:
        """Send a streamed request for `plan` and never read its answer."""
        parts = urlsplit(self.base)
        secure = parts.scheme == "https"
        host, port = parts.hostname or "127.0.0.1", parts.port or (443 if secure else 80)
        info = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, address = info[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _STALL_RCVBUF)  # before connect
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, address)
        _, writer = await asyncio.open_connection(
            sock=sock, limit=_STALL_RCVBUF, ssl=ssl.create_default_context() if secure else None,
            server_hostname=host if secure else None,
        )
        payload = json.dumps(self.body(plan, True)).encode()
        head = [f"POST {parts.path}{_CHAT} HTTP/1.1", f"host: {parts.netloc}",
                "content-type: application/json", f"content-length: {len(payload)}",
                *(f"{k}: {v}" for k, v in self.headers(None).items())]
        writer.write(("\r\n".join(head) + "\r\n\r\n").encode() + payload)
        await writer.drain()
        return Stalled(plan.tag, time.monotonic(), writer)


def _head(out: Outcome, response: httpx.Response) -> None:
    out.status, out.answered_at = response.status_code, time.monotonic()
    out.headers = {k.lower(): v for k, v in response.headers.items()}


async def _events(response: httpx.Response) -> AsyncIterator[str]:
    async for line in response.aiter_lines():
        if line.startswith("data:"):
            yield line[5:].strip()


def _event(out: Outcome, data: str) -> None:
    if out.done_events:
        out.after_end = True
    if data == "[DONE]":
        out.done_events += 1
        return
    try:
        chunk = json.loads(data)
    except ValueError:
        out.failure = f"an event that is not JSON: {data[:80]!r}"
        return
    if not isinstance(chunk, dict):
        out.failure = f"an event that is not an object: {data[:80]!r}"
        return
    if "error" in chunk:
        out.error_events += 1
        out.error_codes.append(str((chunk["error"] or {}).get("code")))
        return
    if out.error_events:
        out.after_end = True  # tokens after an error event
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        out.tokens += len(_TOKEN.findall(str(delta.get("content") or choice.get("text") or "")))


def _whole(out: Outcome, raw: bytes) -> None:
    try:
        answer = json.loads(raw)
    except ValueError:
        out.failure = f"a whole answer that is not JSON: {raw[:80]!r}"
        return
    if "error" in answer:
        out.error_events += 1
        out.error_codes.append(str((answer["error"] or {}).get("code")))
        return
    for choice in answer.get("choices") or []:
        message = choice.get("message") or {}
        out.tokens += len(_TOKEN.findall(str(message.get("content") or choice.get("text") or "")))

"""The HTTP client to vLLM backends: open a streamed completion, read its SSE events, abort it.

Completions go through `http1.ConnectionPool` (the per-chunk hot path; see there why not
httpx), scrapes through httpx. Every request goes upstream as a stream, whatever the client
asked for: the gateway needs each token as it is made to time the first token, grow the KV
ledger, and keep the partial text when a deadline cuts a reply. Aborting is closing the
response: vLLM aborts a request whose connection closes, which frees its KV blocks at once.
Both clients verify an https backend's certificate against the roots the relay trusts: the
backend's `tls_ca_file` alone, else certifi's Mozilla set, and show its `tls_client_cert` to a
backend that asks for one (`trusted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import os
import ssl
from typing import TYPE_CHECKING, Any, NamedTuple

import anyio
import certifi
import httpx

from llmflow.gateway.http1 import (
    ConnectionLost,
    ConnectionPool,
    HttpResponse,
    Origin,
    ProtocolError,
    origin,
)
from llmflow.gateway.sse_decode import EventTooLarge, SseDecoder

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable, Mapping

    from llmflow.gateway.http1 import Connection
    from llmflow.gateway.types import Json

__all__ = ["TlsFiles", "Upstream", "UpstreamError", "UpstreamStream", "trusted", "why"]

_CONNECT_TIMEOUT_S = 5.0  # a backend that does not accept within this is treated as down
_WRITE_TIMEOUT_S = 30.0  # sending one request body
_ERROR_BODY_LIMIT = 64 * 1024  # bytes of an upstream error body worth reading
MAX_EVENT_BYTES = 16 * 1024 * 1024  # `server.max_event_bytes`' default
_OUT_OF_FDS = (errno.EMFILE, errno.ENFILE)  # a failed connect that says nothing of the backend
_ANSWER_LIMIT = 16 * 1024 * 1024  # bytes of a JSON answer read whole (P/D's prefill hop)
_TAIL_WAIT_S = 0.05  # after [DONE], how long the body's end may take before we drop the link


def why(exc: BaseException) -> str:
    """What went wrong, for a client's error message: the OS's words for an errno, else the
    exception's kind, never its text (which names the backend's address, a file, a host)."""
    if isinstance(exc, ssl.SSLError):  # its errno is OpenSSL's, which `strerror` misreads
        return type(exc).__name__
    errno_ = getattr(exc, "errno", None)
    if isinstance(errno_, int) and errno_ > 0:
        return os.strerror(errno_)
    return type(exc).__name__


class TlsFiles(NamedTuple):
    """An https backend's own TLS files, as its config names them."""

    ca_file: str | None = None  # `tls_ca_file`: the only roots its certificate may chain to
    client_cert: str | None = None  # `tls_client_cert`: what the gateway shows when asked
    client_key: str | None = None  # `tls_client_key`; None: in `client_cert`'s file


def trusted(files: TlsFiles | None = None) -> ssl.SSLContext:
    """How an https backend is spoken to: verified against its `ca_file` alone, else certifi's
    Mozilla roots (the set the relay trusts as `webpki-roots`), showing its client certificate
    where it asks for one (mutual TLS); HTTP/1.1 offered by ALPN, as the relay offers it."""
    files = files or TlsFiles()
    context = ssl.create_default_context(cafile=files.ca_file or certifi.where())
    if files.client_cert is not None:
        context.load_cert_chain(files.client_cert, files.client_key)
    context.set_alpn_protocols(["http/1.1"])
    return context


class UpstreamError(Exception):
    """A backend could not serve a request.

    Args:
        status: the status to answer the client with (4xx passed through, 502, 504).
        code: machine-readable reason (`backend_unavailable`, `backend_error`, ...).
        message: what happened.
        backend_down: True when the backend could not be reached at all.
        error: the error object of a backend's 4xx (`{"message", "type", "param", "code"}`):
            the client's mistake, passed to it in vLLM's own words.
    """

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        *,
        backend_down: bool = False,
        error: Json | None = None,
    ):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message
        self.backend_down = backend_down
        self.error = error


class UpstreamStream:
    """One streamed completion from a backend; iterate `events()`, always `aclose()`.

    Args:
        response: the backend's 200, its body unread.
        max_event_bytes: the largest SSE event accepted (`server.max_event_bytes`).
    """

    def __init__(self, response: HttpResponse, max_event_bytes: int = MAX_EVENT_BYTES) -> None:
        self.response = response
        self.max_event_bytes = max_event_bytes
        self.closed = False

    async def events(self, until_done: bool = True) -> AsyncIterator[bytes]:
        """The `data:` payloads of the SSE stream, up to (not including) `[DONE]`.

        `until_done` False: the body's clean end is the stream's end (vLLM's Responses API
        sends no `[DONE]`).

        Raises:
            UpstreamError: the connection broke mid-stream, or an event passed the limit (502).
        """
        decoder = SseDecoder(self.max_event_bytes)
        body = self.response.iter_body()
        try:
            async for piece in body:
                for data in decoder.feed(piece):
                    yield data
                if decoder.done:
                    await _finish(body)
                    return
        except EventTooLarge as exc:  # the backend is fine; this stream cannot go on
            raise UpstreamError(502, "backend_error", str(exc)) from exc
        except (ConnectionLost, OSError) as exc:
            # The connection died under a started reply: the backend is down until a scrape
            # begun after this says otherwise (new requests go elsewhere at once).
            raise UpstreamError(
                502, "backend_error", f"backend stream broke: {why(exc)}", backend_down=True
            ) from exc
        except ProtocolError as exc:
            raise UpstreamError(502, "backend_error", f"backend stream broke: {why(exc)}") from exc
        if until_done or decoder.pending.strip():
            raise UpstreamError(502, "backend_error", "backend stream ended without [DONE]")

    async def aclose(self) -> None:
        """Close the connection (aborting the request upstream if it is still running)."""
        if not self.closed:
            self.closed = True
            self.response.release()


async def _finish(body: AsyncIterator[bytes]) -> None:
    """Read the body's end (it follows `[DONE]` at once), so the connection can be reused."""
    with anyio.move_on_after(_TAIL_WAIT_S), contextlib.suppress(ProtocolError, OSError):
        async for _ in body:
            pass


class Upstream:
    """The backends' HTTP clients: a keep-alive pool for completions, httpx for the rest.

    Args:
        max_connections: httpx pool size, for scrapes.
        max_event_bytes: the largest SSE event a backend may send (`server.max_event_bytes`).
        tls: an https backend's URL -> its own TLS files (`tls_ca_file`, the only roots its
            certificate may chain to; `tls_client_cert` and `tls_client_key`, shown when it
            asks), on both clients.
    """

    def __init__(
        self,
        max_connections: int = 64,
        max_event_bytes: int = MAX_EVENT_BYTES,
        tls: Mapping[str, TlsFiles] | None = None,
    ) -> None:
        self.max_event_bytes = max_event_bytes
        own = {origin(url): trusted(files) for url, files in (tls or {}).items()}
        self.pool = ConnectionPool(_CONNECT_TIMEOUT_S, own, default_tls=trusted)
        limits = httpx.Limits(
            max_connections=max_connections, max_keepalive_connections=max_connections
        )
        timeout = httpx.Timeout(
            connect=_CONNECT_TIMEOUT_S, read=None, write=_WRITE_TIMEOUT_S, pool=_CONNECT_TIMEOUT_S
        )
        # httpx's own default is certifi's roots; a backend with TLS files of its own gets a
        # transport of its own (httpx verifies per transport), mounted on its origin.
        mounts: dict[str, httpx.AsyncBaseTransport | None] = {
            _pattern(key): httpx.AsyncHTTPTransport(verify=context, limits=limits)
            for key, context in own.items()
        }
        self.client = httpx.AsyncClient(
            limits=limits, timeout=timeout, trust_env=False, mounts=mounts
        )

    async def open(
        self,
        base_url: str,
        path: str,
        body: Json,
        request_id: str,
        on_connection: Callable[[Connection], None] | None = None,
        traceparent: str | None = None,
    ) -> UpstreamStream:
        """Send a streamed completion and wait for the backend's response headers.

        Args:
            base_url: the backend, e.g. `http://127.0.0.1:8000`.
            path: `/v1/chat/completions` or `/v1/completions`.
            body: the JSON body (already rewritten for streaming).
            request_id: sent as `X-Request-Id`, so backend logs name the gateway's request.
            on_connection: told the connection before the request goes out on it.
            traceparent: sent as W3C `traceparent` (the request's upstream span), if tracing.

        Returns:
            The open stream (status 200).

        Raises:
            UpstreamError: unreachable (502, `backend_down`), or an error status (4xx passed
                through with the backend's message, 5xx as 502).
        """
        response = await self._request(
            base_url + path, b"text/event-stream", body, request_id, on_connection, traceparent
        )
        return UpstreamStream(response, self.max_event_bytes)

    async def _request(
        self,
        url: str,
        accept: bytes,
        body: Json,
        request_id: str,
        on_connection: Callable[[Connection], None] | None,
        traceparent: str | None = None,
    ) -> HttpResponse:
        """Send one JSON request on the pool and wait for a 200's headers; every failure,
        an error status included, as an `UpstreamError`."""
        head = (
            b"content-type: application/json\r\naccept: " + accept + b"\r\n"
            b"x-request-id: " + request_id.encode() + b"\r\n"
        )
        if traceparent is not None:
            head += b"traceparent: " + traceparent.encode("ascii") + b"\r\n"
        try:
            response = await self.pool.request(
                url, head, json.dumps(body).encode(), on_connection
            )
        except OSError as exc:
            if exc.errno in _OUT_OF_FDS:  # the gateway's own shortage: the backend is fine
                raise UpstreamError(
                    502, "gateway_out_of_fds", "the gateway has no file descriptor left"
                ) from exc
            raise UpstreamError(
                502, "backend_unavailable", f"backend unreachable: {why(exc)}", backend_down=True
            ) from exc
        except (TimeoutError, asyncio.TimeoutError) as exc:  # distinct before 3.11
            raise UpstreamError(
                502, "backend_unavailable", f"backend unreachable: {why(exc)}", backend_down=True
            ) from exc
        except ProtocolError as exc:
            raise UpstreamError(502, "backend_error", f"backend failed: {exc}") from exc
        if response.status != 200:
            raise await _status_error(response)
        return response

    async def post_json(
        self,
        base_url: str,
        path: str,
        body: Json,
        request_id: str,
        on_connection: Callable[[Connection], None] | None = None,
    ) -> Json:
        """Send a request that is not streamed and return its JSON answer (P/D's prefill hop).

        Raises:
            UpstreamError: as `open`, or a body that is not JSON (502).
        """
        response = await self._request(
            base_url + path, b"application/json", body, request_id, on_connection
        )
        try:
            raw = await response.read_all(_ANSWER_LIMIT)
        finally:
            response.release()  # pooled when read to its end, else closed (also when cancelled)
        try:
            answer: Json = json.loads(raw)
        except ValueError as exc:
            raise UpstreamError(502, "backend_error", f"backend sent bad JSON: {exc}") from exc
        return answer

    async def get(self, url: str, timeout_s: float) -> httpx.Response:
        """A plain GET (metrics scrapes), with its own timeout."""
        return await self.client.get(url, timeout=timeout_s)

    async def aclose(self) -> None:
        """Close every pooled connection."""
        self.pool.close()
        await self.client.aclose()


def _pattern(key: Origin) -> str:
    scheme, host, port = key
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"


async def _status_error(response: HttpResponse) -> UpstreamError:
    raw = await response.read_all(_ERROR_BODY_LIMIT)
    response.release()
    message = _error_message(raw) or f"backend answered {response.status}"
    if 400 <= response.status < 500:
        return UpstreamError(
            response.status, "backend_rejected", message, error=_error_object(raw)
        )
    return UpstreamError(502, "backend_error", f"backend error {response.status}: {message}")


def _error_object(raw: bytes) -> Json | None:
    try:
        body: Any = json.loads(raw)
    except ValueError:
        return None
    error = body.get("error") if isinstance(body, dict) else None
    return error if isinstance(error, dict) else None


def _error_message(raw: bytes) -> str:
    try:
        body: Any = json.loads(raw)
    except ValueError:
        return raw[:500].decode("utf-8", "replace").strip()
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message", ""))
    if isinstance(body, dict) and "message" in body:
        return str(body["message"])
    return str(error or "")

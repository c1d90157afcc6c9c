"""Fast refusals: a completion request the runtime refuses is answered below FastAPI.

Under a flood most requests are refused, and on the ordinary path each refusal first costs the
whole request path: an ASGI task, FastAPI's routing and middleware, a session, an exception
and its handler, two writes (about 620 µs of the event loop's CPU per 429 on the 2-core
development VM, `benchmarks/refusal_bench.py`). A burst then queues in front of the one event
loop, and a VIP request waits in the same line before the runtime ever sees its tier.

`HandoffProtocol` holds back a small, plain completion request (POST to `/v1/chat/completions`
or `/v1/completions` with a `Content-Length` body of at most `FAST_BODY_BYTES`, no `Expect`, no
`Transfer-Encoding` or `Content-Encoding`, nothing pipelined ahead of it) until its body is
in, then asks `RefusalDesk.answer`. That runs the ordinary path's own checks (the API key,
then `CompletionService.prepare`: the strict decoder, validation, limits, the prompt estimate)
and feeds the request to the runtime right there, in arrival order:

- when the runtime's pure `refusal` query says it refuses the request, through a party that
  only hears the `Reply` (no session is built); otherwise through `CompletionService.admit`
  and a session, as the route would. Either way `arrive` is fed as on the ordinary path, so
  counters, the Retry-After spread and the trace are the same;
- a refusal is written as the ordinary path writes it (status, OpenAI-style body,
  `Retry-After`, `X-Request-Id`) straight to the transport;
- a request the runtime starts or queues goes on to uvicorn and FastAPI with its session in
  the scope (`admitted_of`), and the route serves it from there.

Bad input and bad keys go on to uvicorn and FastAPI untouched, to get their errors there.
Whether a request is refused, and its Retry-After, are the runtime's alone. (Arriving here
rather than in the route matters under a flood: a request judged "not refused" but arriving
only when its ASGI task ran would leave its queue place to every request read meanwhile, and
they would all fall through to be refused the slow way.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httptools
from uvicorn.protocols.http.httptools_impl import STATUS_LINE

from llmflow.gateway.errors import GatewayError
from llmflow.gateway.middleware import foreign_request
from llmflow.gateway.relay import relayable
from llmflow.gateway.session import reply_error
from llmflow.gateway.signals import read_signals

if TYPE_CHECKING:
    from fastapi import FastAPI

    from llmflow._core import Reply, Start
    from llmflow.gateway.serving import CompletionService
    from llmflow.gateway.session import Prepared, StreamSession
    from llmflow.gateway.types import Endpoint, Scope

__all__ = ["ADMITTED", "FAST_BODY_BYTES", "Admitted", "Held", "RefusalDesk", "admitted_of"]

FAST_BODY_BYTES = 64 * 1024  # bodies up to this are held for the fast path; larger go on at once
_ENDPOINTS: dict[bytes, Endpoint] = {
    b"/v1/chat/completions": "chat",
    b"/v1/completions": "completions",
}
# left to uvicorn and the app (a client's `traceparent`: the route reads it for its span)
_NOT_PLAIN = (b"transfer-encoding", b"expect", b"upgrade", b"traceparent")
_IDENTITY = (b"", b"identity")
ADMITTED = "llmflow.admitted"  # scope extension: a request the runtime took below FastAPI
log = logging.getLogger("llmflow.gateway")


@dataclass(frozen=True, slots=True)
class Admitted:
    """A request judged and fed to the runtime below FastAPI: the route serves its session."""

    prepared: Prepared
    session: StreamSession


def admitted_of(scope: Scope) -> Admitted | None:
    """The request's `Admitted`, when the protocol already fed it to the runtime."""
    extensions = scope.get("extensions") or {}
    return extensions.get(ADMITTED)


@dataclass(slots=True)
class Held:
    """A completion request held back by the protocol until its body is in."""

    endpoint: Endpoint
    authorization: str | None
    http_version: str
    keep_alive: bool
    body: bytearray = field(default_factory=bytearray)
    closing: bool = False  # the server began to shut down meanwhile: close after the answer


class RefusalDesk:
    """Answers, below FastAPI, the completion requests the runtime refuses at once.

    Args:
        app: the gateway's app (`create_app`); the gateway its lifespan starts is read per
            request, so requests before it has started go the ordinary way.
    """

    def __init__(self, app: FastAPI) -> None:
        self.app = app
        self.max_body = min(FAST_BODY_BYTES, app.state.settings.server.max_body_bytes)

    def hold(self, protocol: Any) -> Held | None:
        """Whether to hold a request whose head is in (`protocol`: a `HandoffProtocol`).

        Returns:
            What to keep while its body arrives, or None to serve it the ordinary way now.
        """
        parser = protocol.parser
        if parser.get_method() != b"POST" or protocol.root_path or protocol.limit_concurrency:
            return None
        cycle = protocol.cycle
        if protocol.pipeline or (cycle is not None and not cycle.response_complete):
            return None  # a request ahead of it on this connection is answered first
        try:
            endpoint = _ENDPOINTS.get(httptools.parse_url(protocol.url).path)
        except httptools.HttpParserInvalidURLError:
            return None  # uvicorn answers it
        if endpoint is None:
            return None
        length: int | None = None
        authorization: str | None = None
        host = origin = None
        for name, value in protocol.headers:
            if name == b"host" and host is None:
                host = value
            elif name == b"origin" and origin is None:
                origin = value
            elif name == b"content-length":
                if length is not None or not value.isdigit():
                    return None
                length = int(value)
            elif name == b"authorization" and authorization is None:  # the first, as Starlette
                authorization = value.decode("latin-1")
            elif name in _NOT_PLAIN or (
                name == b"content-encoding" and value.strip().lower() not in _IDENTITY
            ):
                return None
        if length is None or length > self.max_body:
            return None
        own = getattr(self.app.state, "own_hosts", None)
        if own is not None and foreign_request(host, origin, own) is not None:
            return None  # `HostGuard` refuses it on the ordinary path
        version = parser.get_http_version()
        return Held(
            endpoint, authorization, version, version != "1.0" and parser.should_keep_alive()
        )

    def answer(self, protocol: Any, held: Held) -> bool:
        """Feed a held request to the runtime; answer it here if the runtime refuses it.

        Returns:
            True when the refusal was written; False when the request goes on to the app:
            with its session in the scope (`admitted_of`) when the runtime took it, untouched
            when it failed a check (the route answers it with the same error).
        """
        gateway = getattr(self.app.state, "gateway", None)
        service: CompletionService | None = gateway.service if gateway is not None else None
        if gateway is None or service is None:
            return False
        try:
            identity = gateway.keyring.authenticate(held.authorization)
            prepared = service.prepare(held.endpoint, identity, bytes(held.body))
            prepared.signals = read_signals(protocol.headers)  # as the route reads them
        except Exception:  # the ordinary path answers it, with this very error (or its 500)
            return False
        error = _refused(service, prepared)
        if error is None:
            try:
                session = service.admit(prepared, relayable(protocol.scope, prepared))
            except GatewayError as exc:  # refused after all: its bookkeeping was due
                error = exc
            else:
                extensions = protocol.scope.setdefault("extensions", {})
                extensions[ADMITTED] = Admitted(prepared, session)
                return False
        keep_alive = held.keep_alive and not held.closing
        state = protocol.server_state
        protocol.transport.write(_reply_bytes(error, state.default_headers, keep_alive))
        if protocol.access_log:
            client = "{}:{}".format(*protocol.client) if protocol.client else "-"
            path = protocol.url.decode("latin-1")
            line = '%s - "POST %s HTTP/%s" %d'
            protocol.access_logger.info(line, client, path, held.http_version, error.status)
        if not keep_alive:
            protocol.transport.close()
        protocol.on_response_complete()
        # Nothing of the request stays with the idle connection: under a flood thousands of
        # them would otherwise be promoted through the GC's generations, whose collections
        # then pause the loop for tens of milliseconds. The next request builds its own.
        protocol.scope = protocol.headers = None
        return True


class _Refused:
    """The party of a request the runtime refuses on arrival: it only hears the `Reply`."""

    __slots__ = ("reply", "tier")
    queued = False

    def __init__(self, tier: str) -> None:
        self.tier = tier
        self.reply: Reply | None = None

    def on_reply(self, action: Reply) -> None:
        self.reply = action

    def on_start(self, action: Start) -> None:
        pass

    def on_abort(self) -> None:
        pass

    def on_cut(self, reason: str) -> None:
        pass

    def on_end(self, outcome: str) -> None:
        pass


def _refused(service: CompletionService, prepared: Prepared) -> GatewayError | None:
    """The runtime's refusal of a prepared request, fed and counted as `admit` does."""
    party = _Refused(prepared.tier)
    p = prepared
    host = service.ctx.host
    if not host.arrive_refused(
        party, p.tenant, p.prompt_tokens, p.max_tokens, p.options.stream, model=p.model,
        fingerprint=p.fingerprint, signals=p.signals,
    ):
        return None
    assert party.reply is not None  # a refused arrival's one action for its party
    error = reply_error(party.reply)
    service.ctx.metrics.rejected(prepared, error)
    return error


def _reply_bytes(
    error: GatewayError, default_headers: list[tuple[bytes, bytes]], keep_alive: bool
) -> bytes:
    """The response uvicorn writes for `error.response()`: the same head, the same body."""
    response = error.response()
    out: list[bytes | memoryview] = [STATUS_LINE[error.status]]
    for name, value in (*default_headers, *response.raw_headers):
        out += [name, b": ", value, b"\r\n"]
    if not keep_alive:
        out.append(b"connection: close\r\n")
    out += [b"\r\n", response.body]
    return b"".join(out)

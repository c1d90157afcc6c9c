"""The app's middleware answers on the governed routes, given by the front door itself.

A keyless gateway refuses a foreign Host or a cross-site Origin (`HostGuard`, 403
`forbidden_origin`), a compressed body is refused (`BodyLimit`, 415), and a malformed
`x-llmflow-deadline-ms` is the route's 400 `invalid_deadline`. The front answers each of these
on `/v1/chat/completions`, `/v1/completions` and `/v1/responses` itself, byte for byte as the
app alone answers the same raw request (`date` aside), and passes none of them to the app: each
gateway's app is wrapped in a counter of the HTTP requests reaching it. What the app serves
(its other routes) is still judged by the same rule, the core's (`front/origin.rs`), which
`middleware.foreign_request` calls; the last tests hold that rule to the Python it replaced.
"""

from __future__ import annotations

import contextlib
import ipaddress
import json
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from llmflow._core import front_signals
from llmflow.gateway.app import Gateway, create_app
from llmflow.gateway.errors import GatewayError
from llmflow.gateway.middleware import foreign_request
from llmflow.gateway.signals import read_signals

from .both_paths import connect, paths, reply_id, without_date
from .fake_vllm import FakeVllm
from .goldens import with_reference
from .harness import NATIVE_IDS, serve_asgi, serve_gateway, settings_for, until
from .test_front_refusals import Counted

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
ROUTES = {
    CHAT: {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
    "/v1/completions": {"model": "fake-model", "prompt": "hi"},
    "/v1/responses": {"model": "fake-model", "input": "hi"},
}
KEYS: dict[str, Any] = {"tenants": [{"name": "acme", "tier": "normal", "api_keys": ["k-acme"]}]}


class Gw:
    """One gateway under test: its URL, its app's request counter, its runtime, its fake."""

    def __init__(self, url: str, gateway: Gateway, counted: Counted, fake: FakeVllm) -> None:
        self.url, self.gateway, self.counted, self.fake = url, gateway, counted, fake


@contextlib.asynccontextmanager
async def served(native: bool, **sections: Any) -> AsyncIterator[Gw]:
    """A gateway over its own fake, with the front (`native`) or the app alone."""
    fake = FakeVllm()
    async with contextlib.AsyncExitStack() as stack:
        fake_url, _ = await stack.enter_async_context(serve_asgi(fake.app))
        settings = settings_for({"b0": fake_url}, **sections)
        app = create_app(settings)
        counted = Counted(app)
        url = await stack.enter_async_context(serve_gateway(app, counted, front=native))
        gw = Gw(url, app.state.gateway, counted, fake)
        yield gw
        await until(lambda: fake.running == 0 and gw.gateway.runtime.live == 0)


def raw(path: str, headers: str, body: dict[str, Any] | None = None, close: bool = True) -> bytes:
    """A POST of `body` (the route's plain one by default) with `headers` (CRLF-ended lines,
    the Host among them when one is sent)."""
    data = json.dumps(body or {**ROUTES[path], "max_tokens": 2}).encode()
    head = f"POST {path} HTTP/1.1\r\n{headers}content-type: application/json\r\n"
    head += f"content-length: {len(data)}\r\n" + ("connection: close\r\n" if close else "")
    return head.encode("latin-1") + b"\r\n" + data


async def exchange(url: str, request: bytes) -> bytes:
    """Send `request`, read the reply to the end of the connection."""
    reader, writer = await connect(url, request)
    try:
        return await reader.read()
    finally:
        writer.close()


async def on_both(request: bytes, **sections: Any) -> tuple[bytes, bytes]:
    """The reply to `request` from the front and from the app alone; the front's app never
    saw it, and nothing of it reached the runtime or vLLM."""
    replies = []
    for native in paths():
        async with served(native, **sections) as gw:
            before = gw.counted.requests
            reply = await exchange(gw.url, request)
            assert gw.gateway.runtime.live == 0
            assert gw.fake.seen == 0, reply
            if native:
                assert gw.counted.requests == before, reply  # answered by the front
            replies.append(without_date(reply))
    return with_reference(replies)


REFUSED = [  # (headers, the status and the reason the app answers with), keyless
    ("host: rebind.evil.example:8080\r\n", b"403", b"forbidden_origin"),
    ("host: EVIL.Example\r\n", b"403", b"forbidden_origin"),
    ("host: localhost:8000\r\norigin: https://evil.example\r\n", b"403", b"forbidden_origin"),
    ("host: 127.0.0.1:1\r\norigin: null\r\n", b"403", b"forbidden_origin"),
    ("host: 127.0.0.1\r\norigin: http://127.0.0.1:9\r\n", b"403", b"forbidden_origin"),
    ("host: localhost\r\norigin: 'x\xe9\\\"\r\n", b"403", b"forbidden_origin"),
    ("host: x\xe9y.example\r\n", b"403", b"forbidden_origin"),
    ("host: [::1]:8\r\norigin: http://[::1\r\n", b"403", b"forbidden_origin"),
    ("host: localhost\r\ncontent-encoding: gzip\r\n", b"415", b"unsupported_content_encoding"),
    ("host: localhost\r\ncontent-encoding: Br\xe9'\r\n", b"415", b"unsupported_content_encoding"),
    # The Host is judged before the body's encoding, as the middleware runs.
    ("host: evil.example\r\ncontent-encoding: gzip\r\n", b"403", b"forbidden_origin"),
    ("host: localhost\r\nx-llmflow-deadline-ms: 0\r\n", b"400", b"invalid_deadline"),
    ("host: localhost\r\nx-llmflow-deadline-ms:  1.5 \r\n", b"400", b"invalid_deadline"),
    ("host: localhost\r\nx-llmflow-deadline-ms: d\xe9j\xe0'\r\n", b"400", b"invalid_deadline"),
    (
        "host: localhost\r\nx-llmflow-deadline-ms: 5\r\nx-llmflow-deadline-ms: "
        + "9" * 60 + "\r\n",
        b"400",
        b"invalid_deadline",
    ),
]


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize(("headers", "status", "reason"), REFUSED)
async def test_the_middlewares_and_the_deadlines_refusals_are_the_apps_byte_for_byte(
    path: str, headers: str, status: bytes, reason: bytes
) -> None:
    front, app = await on_both(raw(path, headers))
    assert front.startswith(b"HTTP/1.1 " + status), front
    assert b"x-llmflow-reason: " + reason in front, front
    assert front == app


async def test_a_refusal_that_closes_the_connection_closes_it_kept_alive_too() -> None:
    # The middleware's answers end the connection; the deadline's 400 keeps it.
    for headers in ("host: evil.example\r\n", "host: localhost\r\ncontent-encoding: gzip\r\n"):
        front, app = await on_both(raw(CHAT, headers, close=False))
        assert b"connection: close" in front
        assert front == app


async def test_a_gateway_with_keys_refuses_the_encoding_before_the_key_and_judges_no_host() -> (
    None
):
    request = raw(CHAT, "host: evil.example\r\ncontent-encoding: gzip\r\n")
    front, app = await on_both(request, **KEYS)
    assert front.startswith(b"HTTP/1.1 415"), front
    assert front == app
    # With keys, the Host is no matter: a missing key is the route's 401.
    front, app = await on_both(raw(CHAT, "host: evil.example\r\norigin: null\r\n"), **KEYS)
    assert front.startswith(b"HTTP/1.1 401"), front
    assert front == app


SERVED = [  # headers of requests a keyless gateway serves
    "host: localhost:1234\r\norigin: http://localhost:1234\r\n",
    "host: LocalHost:1234\r\norigin: https://localhost:1234/page?x#y\r\n",
    "host: 10.0.0.7\r\n",
    "host: [::1]:8080\r\n",
    "host: [::1]:8080\r\norigin: http://[::1]:8080\r\n",
    "host: [fe80::1%eth0]\r\n",
    "host: gw.internal:80\r\n",
    "host: localhost\r\ncontent-encoding: Identity \r\n",
    # Timeouts Python's float() reads beyond a plain decimal (and the front once declined).
    "host: localhost\r\nx-stainless-timeout: 1_0\r\n",
    "host: localhost\r\nx-stainless-timeout: inf\r\n",
    "host: localhost\r\nx-stainless-read-timeout: 2_5.0\r\n",
]


@pytest.mark.parametrize("headers", SERVED)
async def test_same_origin_pages_and_ip_literals_are_served_natively(headers: str) -> None:
    server = {"allowed_hosts": ["gw.internal"]}
    async with served(True, server=server) as gw:
        before = gw.counted.requests
        reply = await exchange(gw.url, raw(CHAT, headers))
        assert reply.startswith(b"HTTP/1.1 200 OK"), reply
        assert reply_id(reply) >= NATIVE_IDS, reply
        assert gw.counted.requests == before
        assert gw.fake.seen == 1
        assert json.loads(reply.partition(b"\r\n\r\n")[2])["object"] == "chat.completion"


async def test_the_apps_own_routes_are_still_guarded() -> None:
    # The app serves these, and its HostGuard (the same rule) still refuses a foreign Host.
    async with served(True) as gw:
        for path in ("/v1/models", "/api/state"):
            get = f"GET {path} HTTP/1.1\r\nhost: rebind.evil.example\r\nconnection: close\r\n\r\n"
            reply = await exchange(gw.url, get.encode())
            assert reply.startswith(b"HTTP/1.1 403"), reply
            assert b"Host 'rebind.evil.example' is not a name" in reply, reply
        own = "GET /v1/models HTTP/1.1\r\nhost: localhost\r\norigin: http://localhost\r\n"
        reply = await exchange(gw.url, (own + "connection: close\r\n\r\n").encode())
        assert reply.startswith(b"HTTP/1.1 200"), reply


# -- the rule, held to the Python it replaced ---------------------------------------------------


def _python_foreign_request(
    host: bytes | None, origin: bytes | None, allowed: frozenset[str]
) -> str | None:
    """`middleware.foreign_request` as it was in Python (the reference; `urlsplit` may raise)."""
    if host is not None:
        text = host.decode("latin-1")
        if text.startswith("["):
            name = text[1 : text.find("]")] if "]" in text else text
        else:
            left, _, port = text.rpartition(":")
            name = left if left and port.isdigit() else text
        name = name.lower()
        try:
            ipaddress.ip_address(name)
            is_ip = True
        except ValueError:
            is_ip = False
        if name and not is_ip and name not in allowed:
            return (
                f"Host {name!r} is not a name this gateway answers on: add it to "
                "server.allowed_hosts, or configure API keys"
            )
    if origin is not None:
        parts = urlsplit(origin.decode("latin-1").strip())
        if not parts.netloc or parts.netloc.lower() != (host or b"").decode("latin-1").lower():
            text = origin.decode("latin-1")[:100]
            return f"cross-origin request from {text!r} refused by a gateway without API keys"
    return None


_PIECES = st.sampled_from([
    "localhost", "LOCALHOST", "gw.internal", "evil.example", "127.0.0.1", "10.0.0.256", "01.2.3.4",
    "::1", "[::1]", "[::1", "::1]", "[fe80::1%eth0]", "[::ffff:1.2.3.4]", "[1.2.3.4]", "[v1.x]",
    "[v.x]", "1::2::3", ":", "8080", "\xb2", "http://", "https://", "//", "/", "?", "#", "@",
    "null", " ", "\t", "\n", "\x0b", "\x1c", "\x85", "\xa0", "\xc9", "'", '"', "\\", "\x00",
    "%", "%25", "v", ".", "a+b-c.d:",
])
_TEXT = st.one_of(
    st.lists(_PIECES, max_size=5).map("".join),
    st.text(alphabet=st.characters(max_codepoint=255), max_size=12),
).map(lambda s: s.encode("latin-1"))
_HOST = st.one_of(st.none(), _TEXT)


@settings(max_examples=1500, deadline=None)
@given(host=_HOST, origin=_HOST)
def test_the_rule_is_the_pythons_it_replaced(host: bytes | None, origin: bytes | None) -> None:
    allowed = frozenset({"localhost", "gw.internal", "\xe9vil"})
    rust = foreign_request(host, origin, allowed)
    try:
        python = _python_foreign_request(host, origin, allowed)
    except ValueError:
        # `urlsplit` raised (the app answered a 500): the Origin is no same-origin page.
        assert rust is not None
        assert rust.startswith("cross-origin request from "), rust
        return
    assert rust == python


@pytest.mark.parametrize(
    ("host", "origin"),
    [
        (b"[1.2.3.4]", b"http://[1.2.3.4]"),  # an IPv4 address in brackets
        (b"localhost", b"http://[localhost"),  # an unclosed bracket
        (b"[v.x]", b"http://[v.x]"),  # an IPvFuture without its version
    ],
)
def test_an_origin_python_could_not_split_is_refused(host: bytes, origin: bytes) -> None:
    with pytest.raises(ValueError, match=r"IPv|address"):
        _python_foreign_request(host, origin, frozenset({"localhost", "v.x"}))
    reason = foreign_request(host, origin, frozenset({"localhost", "v.x"}))
    assert reason == (
        f"cross-origin request from {origin.decode()!r} refused by a gateway without API keys"
    )


_SIGNAL_NAMES = st.sampled_from([
    b"x-stainless-retry-count", b"x-envoy-attempt-count", b"x-stainless-timeout",
    b"x-stainless-read-timeout", b"x-llmflow-deadline-ms",
])
_SIGNAL_VALUES = st.one_of(
    st.text(alphabet="0123456789.eE+-_ \t\x0b\x0c\x1c\x1finfatyINFATY", max_size=12).map(
        str.encode
    ),
    st.binary(max_size=8),
)


@settings(max_examples=1500, deadline=None)
@given(headers=st.lists(st.tuples(_SIGNAL_NAMES, _SIGNAL_VALUES), max_size=4))
def test_the_front_reads_every_signal_as_python_does(headers: list[tuple[bytes, bytes]]) -> None:
    # Never unsure: it reads what Python reads, and refuses what Python refuses.
    rust = front_signals(headers)
    try:
        python = read_signals(headers)
    except GatewayError as exc:
        status = exc.status
        python = None
    else:
        status = 200
    assert status in (200, 400)
    if python is None:
        assert rust is None
    else:
        assert rust == (python.retries, python.deadline_ms)

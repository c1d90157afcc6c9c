"""Backends served over https, on both paths, checked from outside; mutual TLS too.

The fake vLLM serves TLS on loopback with a certificate its own throwaway CA issued for
`localhost`; the gateway is given that CA as the backend's `tls_ca_file`. Checked: the native
front serves a streamed and a whole reply from it with the bytes an http backend gets (and the
Python path gets from the same https backend), sends SNI, and keeps its connection for the next
request; a certificate the gateway must not trust (another CA's, or one for another name) fails
the request as the Python path fails it, byte for byte, and leaves nothing held. A backend that
asks for a client certificate is shown the one `tls_client_cert` names, by the scraper and both
paths; without one, it refuses the gateway the same way on both paths.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import ssl
from typing import TYPE_CHECKING, Any

import pytest

from llmflow.gateway.app import create_app

from .both_paths import connect, paths, post, without_date
from .certs import Authority
from .fake_vllm import FakeVllm
from .goldens import with_reference
from .harness import NATIVE_IDS, serve_asgi, serve_gateway, settings_for, until
from .test_front_native import _body, _whole_body, _wire

if TYPE_CHECKING:
    from collections.abc import AsyncIterator, Callable
    from pathlib import Path

    from llmflow.gateway.app import Gateway

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"


class Pki:
    """The backend's CA and its certificate for `localhost`, and what the tests swap it for."""

    def __init__(self, directory: Path) -> None:
        self.ca = Authority(directory, "backend")
        self.cert = self.ca.issue(["localhost"])
        # mutual TLS: the CA the backend trusts for its clients, and the gateway's certificate
        self.clients = Authority(directory, "clients")
        self.client = self.clients.issue_client("llmflow")
        self.unknown_ca = Authority(directory, "stranger").issue(["localhost"])
        self.wrong_name = self.ca.issue(["wrong.example"])


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return Pki(tmp_path_factory.mktemp("pki"))


class Backend:
    """A fake vLLM over TLS: its base URL, the uvicorn server's TLS context (to swap the
    certificate it shows), and the server names clients asked for (SNI), one per handshake."""

    def __init__(self, fake: FakeVllm, url: str, context: ssl.SSLContext) -> None:
        self.fake, self.url, self.context = fake, url, context
        self.handshakes: list[str | None] = []
        context.sni_callback = lambda _sock, name, _ctx: self.handshakes.append(name)

    def show(self, cert: tuple[Path, Path]) -> None:
        """Present `cert` from the next handshake on."""
        self.context.load_cert_chain(*cert)


@contextlib.asynccontextmanager
async def tls_backend(
    cert: tuple[Path, Path], clients_ca: Path | None = None
) -> AsyncIterator[Backend]:
    """A fake vLLM showing `cert`; with `clients_ca`, it asks every client for a certificate
    that CA issued and refuses the handshake of one that shows none (mutual TLS)."""
    fake = FakeVllm()
    cert_file, key_file = cert
    asking = {"ssl_cert_reqs": ssl.CERT_REQUIRED, "ssl_ca_certs": str(clients_ca)}
    async with serve_asgi(
        fake.app, ssl_certfile=cert_file, ssl_keyfile=key_file, **(asking if clients_ca else {})
    ) as (url, server):
        assert server.config.ssl is not None
        yield Backend(fake, url.replace("http://127.0.0.1", "https://localhost"), server.config.ssl)


@contextlib.asynccontextmanager
async def gateway_over(
    url: str, native: bool, ca_file: Path | None, client: tuple[Path, Path] | None = None
) -> AsyncIterator[tuple[str, Gateway]]:
    """A gateway whose one backend is `url` (`ca_file`: its `tls_ca_file`; `client`: its
    `tls_client_cert` and `tls_client_key`); yields its base URL and the gateway."""
    own: dict[str, str] = {"tls_ca_file": str(ca_file)} if ca_file is not None else {}
    if client is not None:
        own |= {"tls_client_cert": str(client[0]), "tls_client_key": str(client[1])}
    per_backend = {"b0": own} if own else None
    settings = settings_for({"b0": url}, per_backend=per_backend)
    app = create_app(settings)
    async with serve_gateway(app, front=native) as base:
        yield base, app.state.gateway


async def _exchange(base: str, body: dict[str, Any]) -> tuple[bool, bytes]:
    """Whether the front served `body` natively, and the reply as it went on the wire, less
    what differs by path or run (the date, the request ids, `created`), de-chunked."""
    reader, writer = await connect(base, post(CHAT, body, close=True))
    raw = await asyncio.wait_for(reader.read(), 10)
    writer.close()
    request_id = re.search(rb"x-request-id: llmflow-(\d+)", raw)
    assert request_id is not None, raw
    if b"\r\ntransfer-encoding: chunked" in raw:
        head, _, chunked = raw.partition(b"\r\n\r\n")
        raw = head + b"\r\n\r\n" + _dechunk(chunked)
        raw = re.sub(rb'"created":\d+', b'"created":0', without_date(raw))
        raw = re.sub(rb"llmflow-\d+", b"llmflow-ID", raw)
    else:
        raw = _wire(raw)
    raw = re.sub(rb"-fake\d+", b"-fakeN", raw)  # the fake numbers what it served
    return int(request_id.group(1)) >= NATIVE_IDS, raw


def _dechunk(body: bytes) -> bytes:
    out = b""
    while True:
        size_line, _, body = body.partition(b"\r\n")
        size = int(size_line, 16)
        if size == 0:
            return out
        out, body = out + body[:size], body[size + 2 :]


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_an_https_backend_is_served_natively_with_an_http_backends_bytes(
    pki: Pki, stream: bool
) -> None:
    body = _body(max_tokens=4) if stream else _whole_body(max_tokens=4)
    replies = {}
    async with tls_backend(pki.cert) as backend:
        for native in paths():
            async with gateway_over(backend.url, native, pki.ca.ca_file) as (base, gateway):
                served_natively, replies["https", native] = await _exchange(base, body)
                assert served_natively == native
                if native:  # the next request goes out on the same TLS connection
                    handshakes = len(backend.handshakes)
                    assert (await _exchange(base, body))[0]
                    assert len(backend.handshakes) == handshakes
                await until(lambda g=gateway: g.runtime.live == 0)
        assert backend.fake.completed == len(paths()) + 1
        assert set(backend.handshakes) == {"localhost"}  # SNI, from the scraper and the relay
    fake = FakeVllm()
    async with serve_asgi(fake.app) as (url, _), gateway_over(url, True, None) as (base, _):
        served_natively, replies["http", True] = await _exchange(base, body)
        assert served_natively
    assert replies["https", True] == replies["http", True]
    # the Python path writes a stream's head in its own order (uvicorn's): its body is the same
    head, _, text = replies["https", True].partition(b"\r\n\r\n")
    texts = [replies["https", n].partition(b"\r\n\r\n")[2] for n in paths()]
    _, python_text = with_reference(texts)
    assert python_text == text
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    if stream:
        assert text.endswith(b"data: [DONE]\n\n")
    else:
        assert json.loads(text)["choices"][0]["message"]["content"] == "t0 t1 t2 t3 "


@pytest.mark.parametrize("shown", ["unknown_ca", "wrong_name"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_certificate_not_to_be_trusted_fails_as_on_the_python_path(
    pki: Pki, shown: str, stream: bool
) -> None:
    """The gateway starts against the right certificate (its scrapes keep their connection);
    then the backend shows another CA's certificate, or one for another name: the completion's
    own connection is refused on its handshake, the backend never sees the request, and
    nothing stays held."""
    native_reply, python_reply = with_reference(
        await _failed_once_healthy(pki, stream, lambda b: b.show(getattr(pki, shown)))
    )
    assert native_reply == python_reply
    head, _, text = native_reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 502 ")
    error = json.loads(text)["error"]
    assert error["code"] == "backend_unavailable"
    assert error["message"] == "backend unreachable: SSLCertVerificationError"


async def _failed_once_healthy(
    pki: Pki, stream: bool, change: Callable[[Backend], None]
) -> list[bytes]:
    """On each path: a gateway finds the backend healthy (its scrapes keep their connection),
    then `change` makes the backend refuse new handshakes; the completion's new connection is
    refused, the backend never sees it, and nothing stays held. Returns the replies (the
    native path's, then the Python path's while it is there: `paths`)."""
    body = _body() if stream else _whole_body()
    replies = []
    for native in paths():
        async with tls_backend(pki.cert) as backend:
            async with gateway_over(backend.url, native, pki.ca.ca_file) as (base, gateway):
                state = gateway.scraper.states["b0"]  # type: ignore[union-attr]
                await until(lambda state=state: state.healthy)
                change(backend)
                served_natively, raw = await _exchange(base, body)
                assert served_natively == native
                replies.append(raw)
                await until(lambda g=gateway: g.runtime.live == 0)
                runtime = gateway.runtime
                assert (runtime.running, runtime.queued, runtime.kv_blocks_in_use) == (0, 0, 0)
            assert backend.fake.seen == 0
    return replies


async def test_a_backend_whose_ca_is_not_configured_is_refused_on_both_paths(pki: Pki) -> None:
    """No `tls_ca_file`: the Mozilla roots do not hold the backend's CA, so its scrapes fail
    and each path answers the same 503 as for any backend down, with a Retry-After."""
    replies = []
    async with tls_backend(pki.cert) as backend:
        for native in paths():
            async with gateway_over(backend.url, native, None) as (base, gateway):
                served_natively, raw = await _exchange(base, _body())
                assert served_natively == native
                replies.append(raw)
                assert gateway.runtime.live == 0
        assert backend.fake.seen == 0
    native_reply, python_reply = with_reference(replies)
    assert native_reply == python_reply
    assert native_reply.startswith(b"HTTP/1.1 503 ")
    assert b"\r\nretry-after: " in native_reply
    assert json.loads(native_reply.partition(b"\r\n\r\n")[2])["error"]["code"] == (
        "no_healthy_backend"
    )


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_backend_that_asks_for_a_client_certificate_is_shown_the_configured_one(
    pki: Pki, stream: bool
) -> None:
    """Mutual TLS: the backend refuses any handshake without a certificate its clients' CA
    issued. Given `tls_client_cert` and `tls_client_key`, the scraper (the backend must turn
    healthy) and both completion paths show it, and the reply is the one an http backend gives."""
    body = _body(max_tokens=4) if stream else _whole_body(max_tokens=4)
    replies = {}
    async with tls_backend(pki.cert, pki.clients.ca_file) as backend:
        for native in paths():
            async with gateway_over(backend.url, native, pki.ca.ca_file, pki.client) as (
                base,
                gateway,
            ):
                served_natively, replies[native] = await _exchange(base, body)
                assert served_natively == native
                await until(lambda g=gateway: g.runtime.live == 0)
        assert backend.fake.completed == len(paths())
    # the Python path writes a stream's head in its own order (uvicorn's): its body is the same
    head, _, text = replies[True].partition(b"\r\n\r\n")
    _, python_text = with_reference([replies[n].partition(b"\r\n\r\n")[2] for n in paths()])
    assert python_text == text
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    assert text.endswith(b"data: [DONE]\n\n") if stream else json.loads(text)["choices"]


async def test_a_backend_that_asks_for_a_client_certificate_refuses_a_gateway_without_one(
    pki: Pki,
) -> None:
    """Without `tls_client_cert`, the backend refuses every handshake: its scrapes fail, and
    each path answers the same 503 as for any backend down; the backend never sees a request."""
    replies = []
    async with tls_backend(pki.cert, pki.clients.ca_file) as backend:
        for native in paths():
            async with gateway_over(backend.url, native, pki.ca.ca_file) as (base, gateway):
                served_natively, raw = await _exchange(base, _body())
                assert served_natively == native
                replies.append(raw)
                assert gateway.runtime.live == 0
        assert backend.fake.seen == 0
    replies = list(with_reference(replies))
    assert replies[0] == replies[1]
    assert replies[0].startswith(b"HTTP/1.1 503 ")


REFUSED_HANDSHAKE = {
    ("backend_unavailable", "backend unreachable: SSLError"),
    ("backend_unavailable", "backend unreachable: Connection reset by peer"),
    ("backend_error", "backend failed: no response head: the backend closed the connection"),
}


@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_client_certificate_asked_for_later_fails_as_on_the_python_path(
    pki: Pki, stream: bool
) -> None:
    """The backend starts asking for a client certificate after the gateway found it healthy
    (its scrapes keep their connection); the completion's new connection shows none, the
    backend refuses it, and each path answers a 502 in the words the other uses for the same
    refusal, with nothing held."""

    def ask(backend: Backend) -> None:
        backend.context.load_verify_locations(pki.clients.ca_file)
        backend.context.verify_mode = ssl.CERT_REQUIRED

    # How the backend refuses depends on timing, not on the path: the alert it sends is read
    # (SSLError), or its reset of the connection that still held the request arrives first,
    # or its close is read before either. Each path words each as the other does.
    for reply in await _failed_once_healthy(pki, stream, ask):
        head, _, text = reply.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 502 "), reply
        error = json.loads(text)["error"]
        assert (error["code"], error["message"]) in REFUSED_HANDSHAKE, error
        assert f"\r\nx-llmflow-reason: {error['code']}\r\n".encode() in head + b"\r\n"

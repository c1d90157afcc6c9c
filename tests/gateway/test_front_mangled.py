"""Mangled requests on the wire: the front answers one natively only with the app's bytes.

Two gateways run for the module, built alike (`test_front_refusals.served`): one as `llmflow
serve` runs it, the other the app alone, which answers every completion (the reference: the
app's answer to a request the front passes it). Each holds its one slot, so a request the
checks pass is refused by the runtime (429), and every answer is a whole body of a declared
length. Each example sends the same raw request (a mangled body, a key good or not) to both,
on fresh connections. The native gateway's app must never see it: the front is sure of every
body. Where the answer is no runtime refusal (it has no `x-request-id`), the front answered it
from its checks, and it must be the reference's byte for byte, the `date` header aside.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import threading
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from .test_front_checks import mangled, raws
from .test_front_refusals import Served, served

if TYPE_CHECKING:
    from collections.abc import Iterator

_DATE = re.compile(rb"\r\ndate: [^\r]*")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_KEYS = st.sampled_from(["Bearer k-crowd"] * 4 + ["Bearer k-other", "Basic k-crowd", ""])


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Served, Served]]:
    """The two gateways, each holding its slot, on an event loop of their own."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    stack = contextlib.AsyncExitStack()

    async def up() -> tuple[Served, Served]:
        fast = await stack.enter_async_context(served(native=True))
        slow = await stack.enter_async_context(served(native=False))
        for gw in (fast, slow):
            await gw.hold_the_slot()
        return fast, slow

    try:
        yield asyncio.run_coroutine_threadsafe(up(), loop).result(60)
    finally:
        asyncio.run_coroutine_threadsafe(stack.aclose(), loop).result(60)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def _exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            data += _recv(sock)
        head, body = data.split(b"\r\n\r\n", 1)
        length = next(
            int(line.split(b":")[1])
            for line in head.split(b"\r\n")
            if line.lower().startswith(b"content-length:")
        )
        while len(body) < length:
            body += _recv(sock)
        return head + b"\r\n\r\n" + body


def _recv(sock: socket.socket) -> bytes:
    chunk = sock.recv(65536)
    assert chunk, "the gateway closed the connection before its answer was whole"
    return chunk


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.too_slow,
          HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_a_mangled_request_is_answered_natively_as_the_app_answers_it(
    pair: tuple[Served, Served], endpoint: str, data: st.DataObject
) -> None:
    fast, slow = pair
    body = data.draw(mangled(endpoint) | raws(endpoint))  # broken bytes, or hostile fields
    body = body.replace(b'"wide"', b'"fake-model"')  # the model these gateways serve
    key = data.draw(_KEYS)
    auth = f"authorization: {key}\r\n" if key else ""
    request = (
        f"POST {PATHS[endpoint]} HTTP/1.1\r\nhost: localhost\r\n{auth}".encode()
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )
    seen = fast.counted.requests
    native = _exchange(fast.url, request)
    reference = _exchange(slow.url, request)
    assert fast.counted.requests == seen, f"passed to the app: {request!r}"
    status = native.split(b" ", 2)[1].decode()
    if b"\r\nx-request-id: " in native:
        event(f"the runtime: {status}")
        return
    event(f"answered natively: {status}")
    assert status in ("400", "401", "404"), native
    assert _DATE.sub(b"", native) == _DATE.sub(b"", reference)

"""Mangled requests on the wire: the front answers one natively only with the app's bytes.

Two gateways run for the module, built alike (`test_front_refusals.served`): one as `llmflow
serve` runs it, the other the app alone, which answers every completion (the reference: the
app's answer to a request the front passes it). Each holds its one slot, so a request the
checks pass is refused by the runtime (429), and every answer is a whole body of a declared
length. Each example sends the same raw request (a mangled body, a key good or not) to both,
on fresh connections. The native gateway's app must never see it: the front is sure of every
body. Where the answer is no runtime refusal (it has no `x-request-id`), the front answered it
from its checks, and it must be the reference's byte for byte, the `date` header aside.

Requests drawn at random have no golden; a corpus drawn once from the same strategies does:
kept with the app's answers to them (`goldens.inputs`), it is replayed every run, and is the
reference that is left once the Python path is gone (then the random examples are checked
only for what needs no reference).
"""

from __future__ import annotations

import re
import socket
import warnings
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from hypothesis.errors import NonInteractiveExampleWarning

from .goldens import inputs, with_reference
from .harness import on_a_loop_of_their_own
from .test_front_checks import mangled, raws
from .test_front_refusals import Served, served, served_by_python

if TYPE_CHECKING:
    import contextlib
    from collections.abc import Iterator

_DATE = re.compile(rb"\r\ndate: [^\r]*")
PATHS = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
_KEYS = st.sampled_from(["Bearer k-crowd"] * 4 + ["Bearer k-other", "Basic k-crowd", ""])
CORPUS = 120  # requests an endpoint's corpus keeps (drawn once, when its golden is recorded)


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Served, Served | None]]:
    """The two gateways, each holding its slot, on an event loop of their own (the app's
    while the Python path is there, else None)."""
    async def up(stack: contextlib.AsyncExitStack[Any]) -> tuple[Served, Served | None]:
        fast = await stack.enter_async_context(served(native=True))
        slow = await stack.enter_async_context(served_by_python())
        for gw in (fast, slow):
            if gw is not None:
                await gw.hold_the_slot()
        return fast, slow

    with on_a_loop_of_their_own(up) as pair:
        yield pair


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
    pair: tuple[Served, Served | None], endpoint: str, data: st.DataObject
) -> None:
    fast, slow = pair
    request = _request(endpoint, data.draw(_bodies(endpoint)), data.draw(_KEYS))
    seen = fast.counted.requests
    native = _exchange(fast.url, request)
    if slow is not None:
        reference = _exchange(slow.url, request)
    assert fast.counted.requests == seen, f"passed to the app: {request!r}"
    status = native.split(b" ", 2)[1].decode()
    if b"\r\nx-request-id: " in native:
        event(f"the runtime: {status}")
        return
    event(f"answered natively: {status}")
    assert status in ("400", "401", "404"), native
    if slow is not None:
        assert _DATE.sub(b"", native) == _DATE.sub(b"", reference)


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_the_kept_mangled_requests_are_answered_natively_as_the_app_answered_them(
    pair: tuple[Served, Served | None], endpoint: str
) -> None:
    fast, slow = pair
    gateways = [gw for gw in (fast, slow) if gw is not None]
    by_checks: list[list[int]] = [[] for _ in gateways]  # per path: what its checks answered
    for n, request in enumerate(inputs(lambda: _drawn(endpoint))):
        seen = fast.counted.requests
        answers = [_exchange(gw.url, request) for gw in gateways]
        assert fast.counted.requests == seen, f"passed to the app: {request!r}"
        for answered, answer in zip(by_checks, answers, strict=True):
            if b"\r\nx-request-id: " not in answer:  # else the runtime's refusal
                answered.append(n)
        native = answers[0]
        if b"\r\nx-request-id: " in native:
            continue
        assert native.split(b" ", 2)[1] in (b"400", b"401", b"404"), native
        ours, theirs = with_reference([_DATE.sub(b"", a) for a in answers], f"answer {n}")
        assert ours == theirs
    native_checked, python_checked = with_reference(by_checks, "answered by the checks")
    assert native_checked == python_checked


def _bodies(endpoint: str) -> st.SearchStrategy[bytes]:
    """Broken bytes, or hostile fields, naming the model these gateways serve."""
    return (mangled(endpoint) | raws(endpoint)).map(lambda b: b.replace(b'"wide"', b'"fake-model"'))


def _request(endpoint: str, body: bytes, key: str) -> bytes:
    auth = f"authorization: {key}\r\n" if key else ""
    return (
        f"POST {PATHS[endpoint]} HTTP/1.1\r\nhost: localhost\r\n{auth}".encode()
        + b"content-length: %d\r\n\r\n" % len(body)
        + body
    )


def _drawn(endpoint: str) -> list[bytes]:
    """A corpus's requests, drawn from the property test's strategies (outside a test of
    theirs: `example()`, its warning that this is no test silenced)."""
    requests = st.builds(_request, st.just(endpoint), _bodies(endpoint), _KEYS)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", NonInteractiveExampleWarning)
        return [requests.example() for _ in range(CORPUS)]

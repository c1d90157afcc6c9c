"""The governed routes' unusual framings, answered by the front as the app answers them.

A chunked body, `Expect: 100-continue`, a declared body over `server.max_body_bytes` and a
method other than POST on `/v1/chat/completions`, `/v1/completions` and `/v1/responses` were
passed to the app; the front now answers them itself. Two gateways run for the module, built
alike (`test_front_refusals.served`: API keys, so no Host guard): one as `llmflow serve` runs
it, the other the app alone (the reference: what the app answered when the front passed these
on). Each case sends the same raw request, in parts a moment apart, then a `GET /health` on the
same connection, to both: the bytes read until the server closes must be the same (the date,
the request id's number, the fake's ids and clock aside), so the connection's fate (kept alive:
the health check answered; closed: not) is the same too; and the native gateway's app must
see the request only where the front still passes it on (an upgrade; one its native server
declines, as a target with a query string).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import struct
import time
from typing import TYPE_CHECKING, Any

import pytest

from .both_paths import PYTHON_PATH, paths
from .goldens import with_reference
from .harness import on_a_loop_of_their_own
from .test_front_refusals import Served, served

if TYPE_CHECKING:
    from collections.abc import Callable, Iterator

LIMIT = 2048  # server.max_body_bytes of both gateways
KEY = "authorization: Bearer k-crowd\r\n"
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
HEALTH = b"GET /health HTTP/1.1\r\nhost: 127.0.0.1\r\nconnection: close\r\n\r\n"
_BLANKED = re.compile(
    rb"(\r\ndate: )[^\r]*|(\"created(?:_at)?\":)\d+|(\r\nx-request-id: llmflow-)\d+|(fake)\d+"
)


def _body(path: str = COMPLETIONS, **extra: object) -> bytes:
    body: dict[str, object] = {"model": "fake-model", "max_tokens": 3, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    elif path == COMPLETIONS:
        body["prompt"] = "hi"
    else:
        body = {"model": "fake-model", "max_output_tokens": 3, "input": "hi", **extra}
    return json.dumps(body).encode()


def _head(path: str, *lines: str, method: str = "POST", key: str = KEY) -> bytes:
    head = f"{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\n{key}content-type: application/json\r\n"
    return (head + "".join(f"{line}\r\n" for line in lines) + "\r\n").encode()


def _sized(path: str, body: bytes, *lines: str, **head: str) -> bytes:
    return _head(path, f"content-length: {len(body)}", *lines, **head) + body


def _chunks(*parts: bytes, ext: bytes = b"", trailer: bytes = b"") -> bytes:
    framed = b"".join(b"%x%s\r\n%s\r\n" % (len(p), ext, p) for p in parts)
    return framed + b"0\r\n" + trailer + b"\r\n"


def _pieces(data: bytes, size: int) -> list[bytes]:
    return [data[i : i + size] for i in range(0, len(data), size)]


CHUNKED = "transfer-encoding: chunked"
BODY = _body()
SPLIT = _chunks(BODY[:7], BODY[7:30], BODY[30:], ext=b';a=b;q="x y"', trailer=b"x-t: 1\r\n")
# name: (the request in parts sent a moment apart, whether the native gateway's app sees it)
CASES: dict[str, tuple[list[bytes], bool]] = {
    # chunked, served natively: split chunks, extensions and a trailer, in several writes
    "chunked": ([_head(COMPLETIONS, CHUNKED), *_pieces(SPLIT, 9)], False),
    "chunked_chat": ([_head(CHAT, CHUNKED), _chunks(*_pieces(_body(CHAT), 5))], False),
    "chunked_responses": (
        [_head("/v1/responses", CHUNKED), _chunks(_body("/v1/responses"))],
        False,
    ),
    "chunked_empty": ([_head(COMPLETIONS, CHUNKED), b"0\r\n\r\n"], False),
    "chunked_bad_key": ([_head(COMPLETIONS, CHUNKED, key=""), SPLIT], False),
    "chunked_bad_json": ([_head(COMPLETIONS, CHUNKED), _chunks(b'{"model": ')], False),
    # framing llhttp refuses: 400 invalid_http, closed
    "chunked_bad_size": ([_head(COMPLETIONS, CHUNKED), b"zz\r\nhello\r\n0\r\n\r\n"], False),
    "chunked_bad_end": ([_head(COMPLETIONS, CHUNKED), b"3\r\nabcX\r\n0\r\n\r\n"], False),
    "chunked_bare_lf": ([_head(COMPLETIONS, CHUNKED), b"3\nabc\r\n0\r\n\r\n"], False),
    "chunked_space_ext": ([_head(COMPLETIONS, CHUNKED), b"3 ;a\r\nabc\r\n0\r\n\r\n"], False),
    # over the limit as it arrives: the app's 413, the rest read past, kept alive
    "chunked_over": ([_head(COMPLETIONS, CHUNKED), _chunks(*[b" " * 1000] * 3)], False),
    "chunked_over_split": (
        [_head(COMPLETIONS, CHUNKED), *_pieces(_chunks(b" " * 3000), 700)],
        False,
    ),
    "chunked_over_bad_key": ([_head(COMPLETIONS, CHUNKED, key=""), _chunks(b" " * 3000)], False),
    # Expect: the 100 before the body is read; none before an answer the app gives first
    "expect": (
        [_head(COMPLETIONS, f"content-length: {len(BODY)}", "expect: 100-continue"), BODY],
        False,
    ),
    "expect_chunked": ([_head(CHAT, CHUNKED, "expect: 100-continue"), _chunks(_body(CHAT))], False),
    "expect_bad_key": (
        [_head(COMPLETIONS, f"content-length: {len(BODY)}", "expect: 100-continue", key=""), BODY],
        False,
    ),
    "expect_over": ([_head(COMPLETIONS, "content-length: 5000", "expect: 100-continue")], False),
    "expect_other": ([_sized(COMPLETIONS, BODY, "expect: something-else")], False),
    # a declared length over the limit: BodyLimit's 413, connection closed
    "sized_over": ([_sized(COMPLETIONS, b" " * 3000)[:-2000]], False),
    "sized_over_bad_key": ([_head(CHAT, "content-length: 3000", key="")], False),
    # other methods: the router's 405 (with `allow`), before the key; a body read past
    "get": ([_head(COMPLETIONS, method="GET", key="")], False),
    "head": ([_head(CHAT, method="HEAD")], False),
    "put": ([_sized("/v1/responses", b"{}", method="PUT")], False),
    "options": ([_head(COMPLETIONS, method="OPTIONS")], False),
    "delete_chunked": ([_head(CHAT, CHUNKED, method="DELETE"), _chunks(b"abc")], False),
    "get_over": ([_head(COMPLETIONS, "content-length: 5000", method="GET")], False),
    "head_over": ([_head(CHAT, "content-length: 5000", method="HEAD")], False),
    # a query string, chunked, with a 100 asked: served natively all the same
    "chunked_query": (
        [_head(COMPLETIONS + "?x=1", CHUNKED, "expect: 100-continue"), SPLIT],
        False,
    ),
}


@pytest.fixture(scope="module")
def pair() -> Iterator[tuple[Served, Served]]:
    """The native gateway and the app alone, on an event loop of their own."""
    async def up(stack: contextlib.AsyncExitStack[Any]) -> tuple[Served, Served]:
        server = {"max_body_bytes": LIMIT, "read_timeout_ms": 3000}
        fast = await stack.enter_async_context(served(native=True, server=server))
        slow = await stack.enter_async_context(served(native=False, server=server))
        return fast, slow

    with on_a_loop_of_their_own(up) as pair:
        yield pair


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


def _exchange(url: str, parts: list[bytes]) -> bytes:
    """Send `parts` a moment apart, then the health check; all the server writes until it
    closes (the health check says close: a connection kept alive is closed after it)."""
    with _connect(url) as sock:
        for part in parts:
            sock.sendall(part)
            time.sleep(0.02)
        with contextlib.suppress(OSError):  # a connection closed after its answer
            sock.sendall(HEALTH)
        data = b""
        while chunk := _recv(sock):
            data += chunk
        return data


def _recv(sock: socket.socket) -> bytes:
    try:
        return sock.recv(65536)
    except ConnectionResetError:
        return b""


def _comparable(raw: bytes) -> bytes:
    return _BLANKED.sub(lambda m: next(g for g in m.groups() if g) + b"-", raw)


def _until(predicate: Callable[[], bool], timeout_s: float = 5.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.01)


def _idle(gw: Served) -> bool:
    return gw.gateway.runtime.live == 0 and gw.fake.running == 0


@pytest.mark.parametrize("case", CASES.keys())
def test_the_front_answers_as_the_app_answers(pair: tuple[Served, Served], case: str) -> None:
    fast, slow = pair
    parts, passed = CASES[case]
    seen = fast.counted.requests
    native = _exchange(fast.url, parts)
    replies = [_comparable(native)]
    if PYTHON_PATH:
        replies.append(_comparable(_exchange(slow.url, parts)))
    held, reference = with_reference(replies)
    assert held == reference, (held, reference)
    # the health check, on the same connection, is the app's: counted where it was answered
    health = native.endswith(b'{"status":"ok"}')
    assert fast.counted.requests - seen == int(passed) + int(health), native
    _until(lambda: _idle(fast) and _idle(slow))


def test_a_chunked_request_gets_the_reply_its_sized_twin_gets(pair: tuple[Served, Served]) -> None:
    fast, _ = pair
    body = _body(CHAT, stream=True)
    sized = _exchange(fast.url, [_sized(CHAT, body)])
    seen = fast.counted.requests
    one_byte_chunks = _chunks(*_pieces(body, 1), ext=b";n=1", trailer=b"x-a: 1\r\nx-b: 2\r\n")
    chunked = _exchange(fast.url, [_head(CHAT, CHUNKED), *_pieces(one_byte_chunks, 64)])
    assert b"data: [DONE]" in sized
    assert _comparable(chunked) == _comparable(sized)
    assert fast.counted.requests == seen + 1  # the health check alone reached the app


def test_an_h2c_upgrade_is_ignored_and_the_request_served(pair: tuple[Served, Served]) -> None:
    """An HTTP/1.1 server may ignore `Upgrade`: a POST asking for h2c gets the reply its
    plain twin gets, served natively (the app's uvicorn dropped its body: a 400)."""
    fast, _ = pair
    plain = _exchange(fast.url, [_sized(COMPLETIONS, BODY)])
    seen = fast.counted.requests
    upgrade = _exchange(
        fast.url, [_sized(COMPLETIONS, BODY, "connection: upgrade", "upgrade: h2c")]
    )
    assert plain.startswith(b"HTTP/1.1 200 OK\r\n"), plain
    assert _comparable(upgrade) == _comparable(plain)
    assert fast.counted.requests == seen + 1  # the health check alone reached the app


def test_the_100_comes_before_the_body_and_not_before_an_early_answer(
    pair: tuple[Served, Served],
) -> None:
    for gw in pair[: len(paths())]:  # and the app alone, while it served these routes
        expect = _head(COMPLETIONS, f"content-length: {len(BODY)}", "expect: 100-continue")
        with _connect(gw.url) as sock:
            sock.sendall(expect)
            assert sock.recv(65536) == b"HTTP/1.1 100 Continue\r\n\r\n"  # the body not sent
            sock.sendall(BODY)
            assert _recv(sock).startswith(b"HTTP/1.1 200 OK\r\n")
        refused = _head(COMPLETIONS, "content-length: 3", "expect: 100-continue", key="")
        with _connect(gw.url) as sock:
            sock.sendall(refused)
            assert _recv(sock).startswith(b"HTTP/1.1 401 Unauthorized\r\n")  # no 100 first
            sock.sendall(b"abc" + HEALTH)  # the body read past, the next request answered
            assert b'{"status":"ok"}' in b"".join(iter(lambda s=sock: _recv(s), b""))


def test_a_chunked_body_past_the_limit_costs_nothing(pair: tuple[Served, Served]) -> None:
    fast, _ = pair
    seen = (fast.counted.requests, fast.fake.seen)
    over = _exchange(fast.url, [_head(COMPLETIONS, CHUNKED), *_pieces(_chunks(b"x" * 5000), 512)])
    assert over.startswith(b"HTTP/1.1 413 Request Entity Too Large\r\n"), over
    assert b'"code":"body_too_large"' in over
    assert over.endswith(b'{"status":"ok"}'), over  # kept alive: the health check answered
    _until(lambda: _idle(fast))
    assert (fast.counted.requests, fast.fake.seen) == (seen[0] + 1, seen[1])


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_client_that_resets_mid_chunked_body_leaks_nothing(pair: tuple[Served, Served]) -> None:
    fast, _ = pair
    _exchange(fast.url, [_sized(COMPLETIONS, BODY)])  # warm: the fake's connection is open
    fds, seen = _fds(), (fast.counted.requests, fast.fake.seen)
    for cut in (len(_head(COMPLETIONS, CHUNKED)) + 5, len(_head(COMPLETIONS, CHUNKED)) + 40):
        with _connect(fast.url) as sock:
            sock.sendall((_head(COMPLETIONS, CHUNKED) + SPLIT)[:cut])
            time.sleep(0.05)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    _until(lambda: _fds() <= fds and _idle(fast))
    assert (fast.counted.requests, fast.fake.seen) == seen
    after = _exchange(fast.url, [_sized(COMPLETIONS, BODY)])
    assert after.startswith(b"HTTP/1.1 200 OK\r\n"), after


def test_keep_alive_and_pipelining_after_a_chunked_request(pair: tuple[Served, Served]) -> None:
    fast, _ = pair
    seen = fast.fake.seen
    chunked = _head(COMPLETIONS, CHUNKED) + SPLIT
    # all in one write: a chunked request, a sized one, another chunked one, the health check
    replies = _exchange(fast.url, [chunked + _sized(COMPLETIONS, BODY) + chunked])
    starts = [m.start() for m in re.finditer(rb"HTTP/1\.1 \d{3} ", replies)]
    assert len(starts) == 4, replies
    assert replies.count(b"HTTP/1.1 200 OK\r\n") == 4, replies
    assert replies.count(b'"text":"t0 t1 t2 "') == 3, replies
    assert fast.fake.seen == seen + 3
    # and one at a time on a kept-alive connection
    with _connect(fast.url) as sock:
        for _ in range(2):
            sock.sendall(_head(COMPLETIONS, CHUNKED))
            time.sleep(0.02)
            sock.sendall(SPLIT)
            reply = b""
            while b'"metrics":null}' not in reply:
                chunk = _recv(sock)
                assert chunk, reply
                reply += chunk
            assert reply.startswith(b"HTTP/1.1 200 OK\r\n"), reply

"""Bad input to a governed route, answered by the front door, is the Python path's answer.

Two gateways, built alike over two fakes, take the same raw requests: one as `llmflow serve`
runs it (the front answers what its checks refuse), the other the app alone (as the front
passes it a request it declines: its answer is the reference). Compared:
every byte of the response but the `date` header's line, with the connection kept alive and
with it closed (`connection: close`, HTTP/1.0), and whether the gateway then ends the
connection or keeps it open. Each app counts the HTTP requests reaching it, so a test sees
from outside that the front answered natively; the trace shows the runtime never heard of it.
After a refusal, a good request on the same keep-alive connection is served as usual. Each
answer is also held to its golden, the Python path's recorded (`goldens`), which is the
reference alone once the Python path is gone.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from .both_paths import on_each_path
from .goldens import with_reference
from .test_front_refusals import KEY, Served, served, served_by_python

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
MESSAGES = [{"role": "user", "content": "hi"}]
GOOD = json.dumps({"model": "fake-model", "messages": MESSAGES, "stream": True}).encode()
LONG_KEY = "Bearer " + "k" * 300  # past limits.max_api_key_bytes (256)
CASES = [  # (id, path, authorization or None, body, status, code)
    ("no-key", CHAT, None, GOOD, 401, "invalid_api_key"),
    ("wrong-key", CHAT, "Bearer k-other", GOOD, 401, "invalid_api_key"),
    ("basic", CHAT, "Basic k-crowd", GOOD, 401, "invalid_api_key"),
    ("long-key", CHAT, LONG_KEY, GOOD, 401, "invalid_api_key"),
    ("bad-key-bad-body", CHAT, "Bearer no", b"{", 401, "invalid_api_key"),
    ("cut-short", CHAT, KEY["authorization"], GOOD[:-9], 400, "invalid_json"),
    ("not-an-object", "/v1/completions", KEY["authorization"], b"[1, 2]", 400, "invalid_json"),
    ("nan", CHAT, KEY["authorization"], GOOD[:-1] + b', "top_p": NaN}', 400, "invalid_json"),
    ("empty", CHAT, KEY["authorization"], b"", 400, "invalid_json"),
    ("bom", CHAT, KEY["authorization"], b"\xef\xbb\xbf" + GOOD, 400, "invalid_json"),
    ("not-utf8", CHAT, KEY["authorization"], GOOD.replace(b"hi", b"h\xe9"), 400, "invalid_json"),
    ("deep", CHAT, KEY["authorization"], b'{"x": ' + b"[" * 300 + b"]" * 300 + b"}", 400,
     "invalid_json"),
    ("infinite", CHAT, KEY["authorization"], GOOD[:-1] + b', "x": 1e999}', 400, "invalid_json"),
    ("unknown-model", CHAT, KEY["authorization"], GOOD.replace(b"fake-model", b"gpt-17"), 404,
     "model_not_found"),
    ("too-long", "/v1/completions", KEY["authorization"],
     b'{"model": "fake-model", "stream": true, "prompt": "%s"}' % (b"lorem " * 4000), 400,
     "context_length_exceeded"),
    ("past-context", CHAT, KEY["authorization"], GOOD[:-1] + b', "max_tokens": 5000}', 400,
     "context_length_exceeded"),
    ("n", "/v1/completions", KEY["authorization"],
     b'{"model": "fake-model", "prompt": ["a", "b"], "n": 100, "stream": true}', 400,
     "n_too_large"),
    ("no-output", "/v1/completions", KEY["authorization"],
     b'{"model": "fake-model", "prompt": "a", "max_tokens": 0}', 400, "invalid_request"),
    ("options", CHAT, KEY["authorization"], GOOD.replace(b"true", b'false, "stream_options": '
     b'{"include_usage": true}'), 400, "invalid_request"),
    ("messages", CHAT, KEY["authorization"], GOOD.replace(b'"messages": [', b'"messages": [' +
     b'{"role": "user", "content": "a"}, ' * 3000), 400, "too_many_messages"),
    ("wrong-type", CHAT, KEY["authorization"], GOOD.replace(b"true", b'"yes"'), 400,
     "invalid_request"),
    ("no-model", CHAT, KEY["authorization"], GOOD.replace(b'"model": "fake-model", ', b""), 400,
     "invalid_request"),
    ("no-messages", CHAT, KEY["authorization"], b'{"model": "fake-model", "stream": true}', 400,
     "invalid_request"),
    ("prompt-shape", "/v1/completions", KEY["authorization"],
     b'{"model": "fake-model", "prompt": [1, "two", {"x": 3.5}], "stream": true}', 400,
     "invalid_request"),
    ("no-role", CHAT, KEY["authorization"], GOOD.replace(b'"role": "user", ', b""), 400,
     "invalid_request"),
    ("stop", CHAT, KEY["authorization"], GOOD[:-1] + b', "stop": ["a", "b", "c", "d", "e"]}', 400,
     "invalid_request"),
    ("bound", CHAT, KEY["authorization"], GOOD[:-1] + b', "top_p": 1.5}', 400, "invalid_request"),
    ("lines", CHAT, KEY["authorization"], b'{\n  "model": "fake-model",\n  "stream": tru\n}', 400,
     "invalid_json"),
]
_DATE = re.compile(rb"\r\ndate: [^\r]*")


async def _exchange(gw: Served, request: bytes, closes: bool) -> bytes:
    """One request on a fresh connection, its response read whole; the gateway ends the
    connection after it when `closes`, and else keeps it open."""
    reader, writer = await asyncio.open_connection(*gw.url.removeprefix("http://").split(":"))
    try:
        writer.write(request)
        response = await _response(reader)
        if closes:
            assert await asyncio.wait_for(reader.read(), 5) == b""
        else:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(reader.read(1), 0.05)
        return response
    finally:
        writer.close()


async def _response(reader: asyncio.StreamReader) -> bytes:
    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    return head + await asyncio.wait_for(reader.readexactly(length), 10)


def _request(
    path: str, authorization: str | None, body: bytes, close: bool = False, version: str = "1.1"
) -> bytes:
    head = f"POST {path} HTTP/{version}\r\nhost: localhost\r\ncontent-type: application/json\r\n"
    if authorization is not None:
        head += f"authorization: {authorization}\r\n"
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"content-length: %d\r\n\r\n" % len(body) + body


@pytest.mark.parametrize(
    ("path", "authorization", "body", "status", "code"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
async def test_bad_input_is_answered_natively_with_the_apps_bytes(
    path: str, authorization: str | None, body: bytes, status: int, code: str
) -> None:
    async with served(native=True) as fast, served_by_python() as slow:
        before = fast.counted.requests
        for close, version in ((False, "1.1"), (True, "1.1"), (False, "1.0")):
            request = _request(path, authorization, body, close, version)
            closes = close or version == "1.0"
            a, *b = [await _exchange(gw, request, closes) for gw in (fast, slow) if gw is not None]
            assert a.startswith(b"HTTP/1.1 %d " % status), a
            assert json.loads(a.split(b"\r\n\r\n", 1)[1])["error"]["code"] == code
            part = f"HTTP/{version}" + (", connection: close" if close else "")
            native, python = with_reference([_DATE.sub(b"", r) for r in (a, *b)], part)
            assert native == python
            assert b"\r\ndate: " in a
        assert fast.counted.requests == before  # the app never saw them
    assert fast.arrivals() == []  # nor did the runtime


@on_each_path("app")
async def test_a_refusal_then_a_good_request_on_one_keep_alive_connection(native: bool) -> None:
    """The connection goes on after a native refusal, as after the app's, and serves the next
    request natively, whole; a pipelined pair is answered in order."""
    async with served(native=native) as gw:
        reader, writer = await asyncio.open_connection(*gw.url.removeprefix("http://").split(":"))
        refused = _request(CHAT, None, GOOD)
        good = _request(CHAT, KEY["authorization"], GOOD)
        for pair in ([refused], [good], [refused, good]):
            for request in pair:
                writer.write(request)
            for request in pair:
                if request is refused:
                    assert (await _response(reader)).startswith(b"HTTP/1.1 401 ")
                else:
                    head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 10)
                    assert head.startswith(b"HTTP/1.1 200 "), head
                    stream = await asyncio.wait_for(reader.readuntil(b"0\r\n\r\n"), 10)
                    assert b"data: [DONE]" in stream, stream
        writer.close()
        assert gw.fake.seen == 2  # both good ones reached vLLM
        assert gw.counted.requests == (0 if native else 4)  # natively: nothing to the app
    assert len(gw.arrivals()) == 2

"""Bad input, each kind once: a 4xx in OpenAI's shape that says what to fix, and nothing upstream.

The JSON-exhaustion class (nesting, huge numbers, bad UTF-8, lone surrogates, NaN/Infinity, a
float overflow, the wrong top level, an empty body) is refused by the one decoder on both
endpoints; every limit in `limits:` and `server.max_body_bytes` gets its own status and code.
The harness checks on exit that no slot, queue entry or KV block was left behind.
"""

from __future__ import annotations

import asyncio
import gzip
import json
import socket
from typing import TYPE_CHECKING

import pytest

from .harness import Harness, start_gateway
from .outside import assert_openai_error

if TYPE_CHECKING:
    import httpx

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
JSON = {"content-type": "application/json"}
_HEAD = b'{"model":"fake-model","max_tokens":2,'
_CHAT_TAIL = b'"messages":[{"role":"user","content":"hi"}]}'

# name -> (body, words the message must contain)
EXHAUSTING = {
    "nested 100k deep": (b"[" * 100_000 + b"]" * 100_000, "nest deeper than 200"),
    "object nested 50k deep": (b'{"a":' * 50_000 + b"1" + b"}" * 50_000, "nest deeper"),
    "field nested 300 deep": (_HEAD + b'"x":' + b"[" * 300 + b"]" * 300 + b"}", "nest deeper"),
    "5,000-digit integer": (_HEAD + b'"seed":' + b"9" * 5000 + b"}", "more digits"),
    "invalid UTF-8": (_HEAD + b'"user":"\xff\xfe",' + _CHAT_TAIL, "not UTF-8"),
    "lone high surrogate": (_HEAD + b'"user":"\\ud800",' + _CHAT_TAIL, "surrogate"),
    "lone low surrogate": (_HEAD + b'"user":"\\udc00x",' + _CHAT_TAIL, "surrogate"),
    "NaN": (_HEAD + b'"temperature":NaN,' + _CHAT_TAIL, "NaN and Infinity are not JSON"),
    "Infinity in an extra field": (_HEAD + b'"top_k":-Infinity,' + _CHAT_TAIL, "NaN and Inf"),
    "float overflow": (_HEAD + b'"temperature":1e400,' + _CHAT_TAIL, "too large for a float"),
    "309-digit float": (_HEAD + b'"x":' + b"9" * 320 + b".5," + _CHAT_TAIL, "too large"),
    "raw control character": (_HEAD + b'"user":"a\x00b",' + _CHAT_TAIL, "control character"),
    "byte-order mark": (b"\xef\xbb\xbf" + _HEAD + _CHAT_TAIL, "byte-order mark"),
    "empty body": (b"", "empty"),
    "top level is a list": (b"[1, 2]", "must be a JSON object"),
    "top level is null": (b"null", "must be a JSON object"),
    "trailing garbage": (_HEAD + _CHAT_TAIL + b" x", "trailing characters"),
}


def _error(r: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert r.status_code == status, r.text
    error = assert_openai_error(r.status_code, r.content, r.headers.get("content-type"))
    assert error["code"] == code, error
    return error


async def test_the_json_exhaustion_class_is_a_400_that_says_what_to_fix(gw: Harness) -> None:
    for path in (CHAT, COMPLETIONS):
        for name, (body, words) in EXHAUSTING.items():
            r = await gw.client.post(path, content=body, headers=JSON)
            message = str(_error(r, 400, "invalid_json")["message"])
            assert words in message, (name, path, message)
    assert gw.fake.seen == 0
    # the gateway carries on: the next request is served
    assert (await gw.client.post(CHAT, json=_chat(max_tokens=1))).status_code == 200


def _chat(content: str = "hi", **extra: object) -> dict[str, object]:
    return {"model": "fake-model", "messages": [{"role": "user", "content": content}], **extra}


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        (_chat(max_tokens=10**30), "max_tokens", "less than or equal to 2147483647"),
        (_chat(max_tokens=0), "max_tokens", "greater than or equal to 1"),
        (_chat(n=0), "n", "greater than or equal to 1"),
        (_chat(temperature=-1), "temperature", "greater than or equal to 0"),
        ({"model": "fake-model", "prompt": [5, -1]}, "prompt", "token ids (integers from 0"),
        ({"model": "fake-model", "prompt": {"a": 1}}, "prompt", "send text, or token ids"),
    ],
)
async def test_out_of_range_fields_are_400_naming_the_field(
    gw: Harness, body: dict[str, object], param: str, words: str
) -> None:
    path = COMPLETIONS if "prompt" in body else CHAT
    r = await gw.client.post(path, json=body)
    assert r.status_code == 400, r.text
    error = assert_openai_error(400, r.content, r.headers.get("content-type"))
    assert error["param"] == param
    assert words in str(error["message"])
    assert gw.fake.seen == 0


async def test_limits_are_400s_that_name_the_setting() -> None:
    limits = {"max_messages": 3, "max_n": 2, "max_tokens": 50}
    async with start_gateway(limits=limits) as h:
        messages = [{"role": "user", "content": "x"}] * 4
        r = await h.client.post(CHAT, json={"model": "fake-model", "messages": messages})
        assert "limits.max_messages" in str(_error(r, 400, "too_many_messages")["message"])
        r = await h.client.post(CHAT, json=_chat(n=3))
        assert "limits.max_n" in str(_error(r, 400, "n_too_large")["message"])
        r = await h.client.post(CHAT, json=_chat(max_tokens=51))
        assert "ask for at most 50" in str(_error(r, 400, "max_tokens_too_large")["message"])
        r = await h.client.post(CHAT, json=_chat(max_completion_tokens=51))
        _error(r, 400, "max_tokens_too_large")
        assert h.fake.seen == 0
        # at the limits, served; without max_tokens the gateway's cap goes upstream
        three = {"model": "fake-model", "messages": messages[:3], "n": 2, "max_tokens": 50}
        assert (await h.client.post(CHAT, json=three)).status_code == 200
        assert (await h.client.post(CHAT, json=_chat())).status_code == 200
        assert [b.get("max_tokens") for b in h.fake.bodies] == [50, 50]
        assert h.fake.tokens_sent == 150  # 2 choices, then 1, of 50 tokens: what it was told


async def test_prompt_over_the_context_is_400_on_both_endpoints(gw: Harness) -> None:
    r = await gw.client.post(CHAT, json=_chat("x" * 20_000))
    _error(r, 400, "context_length_exceeded")
    r = await gw.client.post(COMPLETIONS, json={"model": "fake-model", "prompt": [1] * 4096})
    _error(r, 400, "context_length_exceeded")
    assert gw.fake.seen == 0


async def test_body_over_the_limit_is_413(gw: Harness) -> None:
    big = _chat("x" * (4 * 1024 * 1024 + 1))
    _error(await gw.client.post(CHAT, json=big), 413, "body_too_large")
    assert gw.fake.seen == 0


@pytest.mark.parametrize("encoding", ["gzip", "deflate", "br"])
async def test_a_compressed_body_is_415_and_never_decoded(gw: Harness, encoding: str) -> None:
    bomb = gzip.compress(b" " * 10_000_000)  # 10 MB of spaces in ~10 kB
    r = await gw.client.post(CHAT, content=bomb, headers={**JSON, "content-encoding": encoding})
    assert "send plain JSON" in str(_error(r, 415, "unsupported_content_encoding")["message"])
    assert gw.fake.seen == 0


def _raw_exchange(url: str, request: bytes) -> bytes:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        sock.sendall(request)
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
    return reply


def _split(reply: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = reply.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split()[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("header_bytes", [40_000, 2_000_000])
async def test_headers_over_the_limit_are_431_before_the_app(header_bytes: int) -> None:
    async with start_gateway(limits={"max_header_bytes": 32_768}) as h:
        body = json.dumps(_chat(max_tokens=1)).encode()
        request = (
            b"POST /v1/chat/completions HTTP/1.1\r\n"
            b"host: localhost\r\ncontent-type: application/json\r\n"
            b"x-big: " + b"a" * header_bytes + b"\r\n"
            b"content-length: %d\r\n\r\n" % len(body) + body
        )
        reply = await asyncio.to_thread(_raw_exchange, h.url, request)
        status, headers, payload = _split(reply)
        assert status == 431
        error = assert_openai_error(status, payload, headers.get("content-type"))
        assert "limits.max_header_bytes" in error["message"]
        assert h.fake.seen == 0
        # just under the limit is served
        ok = await h.client.post(CHAT, json=_chat(max_tokens=1), headers={"x-big": "a" * 30_000})
        assert ok.status_code == 200


async def test_bytes_that_are_not_http_get_an_openai_style_400(gw: Harness) -> None:
    for request in (b"GARBAGE\r\n\r\n", b"POST / HTTP/1.1\r\ncontent-length: -5\r\n\r\n"):
        reply = await asyncio.to_thread(_raw_exchange, gw.url, request)
        status, headers, payload = _split(reply)
        assert status == 400
        assert assert_openai_error(status, payload, headers.get("content-type"))["code"] == (
            "invalid_http"
        )


async def test_an_api_key_over_the_size_limit_is_401_without_hashing_it() -> None:
    tenants = [{"name": "acme", "tier": "vip", "api_keys": ["k" * 20]}]
    async with start_gateway(tenants=tenants, limits={"max_api_key_bytes": 64}) as h:
        r = await h.client.post(
            CHAT, json=_chat(max_tokens=1), headers={"authorization": "Bearer " + "k" * 65}
        )
        assert "longer than 64 bytes" in str(_error(r, 401, "invalid_api_key")["message"])
        r = await h.client.post(
            CHAT, json=_chat(max_tokens=1), headers={"authorization": "Bearer " + "k" * 20}
        )
        assert r.status_code == 200
        assert h.fake.seen == 1


async def test_the_openai_client_gets_a_typed_error_with_the_limit() -> None:
    import openai

    async with start_gateway(limits={"max_n": 4}) as h:
        async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="k", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError) as info:
                await c.chat.completions.create(
                    model="fake-model", messages=[{"role": "user", "content": "x"}], n=5
                )
        assert info.value.code == "n_too_large"
        assert "limits.max_n" in info.value.message
        assert h.fake.seen == 0

"""`POST /v1/responses` served natively by the front door, checked from outside.

The Python path (the app served alone, as the front passes it a request it declines) is the
oracle: each test runs the same request on both paths and compares what a client reads (the
bytes of the reply, less its ids and clocks) and what the fake vLLM saw (the body it got, its
own counts of aborts and running requests), and checks that the native one was the front's
(its id from the front's range).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import pytest

from .both_paths import (
    by_front,
    completed,
    connect,
    on_each_path,
    paths,
    post,
    raw_on_both_paths,
    refused_on_both_paths,
    reply_id,
    streamed_on_both_paths,
    unsized,
    without_date,
)
from .goldens import with_reference
from .harness import NATIVE_IDS, assert_idle, start_gateway, until

pytestmark = pytest.mark.anyio
RESPONSES = "/v1/responses"
MESSAGES = [
    {"role": "user", "content": "hi"},
    {"role": "user", "content": [{"type": "input_text", "text": "there"}]},
]


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "fake-model", "input": "hi", "max_output_tokens": 5, **extra}


def _masked(raw: bytes) -> bytes:
    """What differs by path or by run: the date, the ids (the front numbers from its own
    range, the fake by its clock), the clocks."""
    raw = without_date(raw)
    raw = re.sub(rb"llmflow-\d+", b"llmflow-ID", raw)
    return re.sub(rb'"created_at": ?\d+', b'"created_at":0', raw)


def _wire(raw: bytes) -> bytes:
    """A whole reply as it went on the wire, masked; its `content-length` checked against the
    body it heads, then left out (the ids' lengths differ)."""
    return _masked(unsized(raw))


async def _streamed_on_both_paths(
    body: dict[str, Any], steps: int | None = None, **sections: Any
) -> list[tuple[str, dict[str, Any]]]:
    """The body of the streamed reply to `body` on the native front, and what vLLM was sent;
    then their references: the Python path's, or their goldens once it is gone
    (`with_reference`); `steps`: the fake emits that many tokens, then holds the rest."""
    texts, bodies = [], []
    for text, headers, sent in await streamed_on_both_paths(RESPONSES, body, steps, **sections):
        assert headers["content-type"] == "text/event-stream; charset=utf-8"
        texts.append(_masked(text.encode()).decode())
        bodies.append(sent)
    return list(zip(with_reference(texts), with_reference(bodies, "sent"), strict=True))


async def _whole_on_both_paths(
    body: dict[str, Any], steps: int | None = None, **sections: Any
) -> list[bytes]:
    """The raw reply to `body`, not streamed, on the native front, masked, and its reference:
    the Python path's, or its golden once it is gone (`with_reference`)."""
    replies = await raw_on_both_paths(RESPONSES, body, steps, **sections)
    return list(with_reference([_wire(raw) for raw, _ in replies]))


@pytest.mark.parametrize(
    ("inputs", "flush_ms"),
    [("hi", 0), (MESSAGES, 0), ("hi", 20)],
    ids=["text", "messages", "coalesced"],
)
async def test_a_streamed_response_is_the_python_paths_byte_for_byte(
    inputs: Any, flush_ms: int
) -> None:
    # coalesced: frames that come within the flush interval go out together, never merged
    body = _body(
        input=inputs,
        stream=True,
        instructions="be brief",
        priority=5,
        store=True,
        fake={"itl": 0.005 if flush_ms else 0},
    )
    (native, sent_native), (python, sent_python) = await _streamed_on_both_paths(
        body, streaming={"sse_flush_interval": flush_ms}
    )
    assert native == python
    events = re.findall(r"^event: (\S+)$", native, re.M)
    assert events.count("response.output_text.delta") == 5
    assert events[-1] == "response.completed"
    assert "[DONE]" not in native
    # vLLM got the same body either way: streamed, the bound planned, not stored, no priority
    assert sent_native == sent_python
    assert sent_native["stream"] is True
    assert sent_native["store"] is False
    assert sent_native["max_output_tokens"] == 5
    assert "priority" not in sent_native


@pytest.mark.parametrize("inputs", ["hi", MESSAGES], ids=["text", "messages"])
async def test_a_whole_response_is_the_python_paths_byte_for_byte(inputs: Any) -> None:
    native, python = await _whole_on_both_paths(_body(input=inputs))
    assert native == python
    head, _, text = native.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    reply = json.loads(text)
    assert reply["status"] == "completed"
    assert reply["usage"]["output_tokens"] == 5
    assert reply["output"][0]["content"][0]["text"] == "t0 t1 t2 t3 t4 "


async def test_a_streamed_response_cut_by_its_deadline_is_the_python_paths() -> None:
    body = _body(stream=True, max_output_tokens=50, fake={"step": True})
    (native, _), (python, _) = await _streamed_on_both_paths(
        body, steps=2, timeouts={"total_ms": 400}
    )
    assert native == python
    assert native.count("event: response.output_text.delta") == 2
    tail = native.rstrip("\n").rsplit("\n\n", 1)[-1]
    assert tail.startswith("event: error\ndata: ")
    assert json.loads(tail.split("data: ", 1)[1]) == {
        "type": "error",
        "code": "deadline",
        "message": "[llmflow: reply truncated: the request reached its total deadline]",
        "param": None,
    }


async def test_a_whole_response_cut_by_its_deadline_is_the_python_paths() -> None:
    body = _body(max_output_tokens=50, fake={"step": True})
    native, python = await _whole_on_both_paths(body, steps=2, timeouts={"total_ms": 400})
    assert native == python
    head, _, text = native.partition(b"\r\n\r\n")
    assert b"\r\nx-llmflow-reason: deadline" in head
    reply = json.loads(text)
    assert reply["status"] == "incomplete"
    assert reply["incomplete_details"] == {"reason": "deadline"}
    assert reply["output"][0]["content"][0]["text"].startswith("t0 t1 \n\n[llmflow: reply")


@pytest.mark.parametrize(
    "fake",
    [{"status": 500}, {"status": 400}, {"error_after": 2}, {"fail_after": 1}, {"crash_after": 2}],
    ids=["500", "400", "error-event", "response-failed", "crash"],
)
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_an_upstream_failure_is_the_python_paths(fake: dict[str, Any], stream: bool) -> None:
    body = _body(stream=stream, fake=fake)
    if stream:
        native_reply, python_reply = await _dechunked_on_both_paths(body)
    else:
        native_reply, python_reply = await _whole_on_both_paths(body)
    assert native_reply == python_reply
    assert b"HTTP/1.1 200 " not in native_reply or b"event: error" in native_reply


def _dechunked(raw: bytes) -> bytes:
    """A reply's status line and its body (chunked or not), masked: what a client reads (a
    stream's head is uvicorn's on one path and the front's on the other, as for completions)."""
    head, _, body = raw.partition(b"\r\n\r\n")
    if b"transfer-encoding: chunked" in head:
        out = b""
        while body:
            size, _, rest = body.partition(b"\r\n")
            n = int(size, 16)
            out, body = out + rest[:n], rest[n + 2 :]
        body = out
    return _masked(head.split(b"\r\n", 1)[0] + b"\r\n\r\n" + body)


async def _dechunked_on_both_paths(body: dict[str, Any], **sections: Any) -> list[bytes]:
    """What a client reads of the reply to `body` (see `_dechunked`) on the native front, and
    its reference: the Python path's, or its golden once it is gone (`with_reference`)."""
    replies = await raw_on_both_paths(RESPONSES, body, **sections)
    return list(with_reference([_dechunked(raw) for raw, _ in replies]))


_BAD = [
    b"{",
    b"[1]",
    b'{"model": "fake-model", "input": "x", "max_output_tokens": 1e999}',
    b"{}",
    b'{"model": 1, "input": 5}',
    b'{"model": ""}',
    b'{"model": "fake-model"}',
    b'{"model": "fake-model", "input": 5}',
    b'{"model": "fake-model", "input": [{"role": "user"}, 1]}',
    b'{"model": "fake-model", "input": "x", "instructions": ["a"]}',
    b'{"model": "fake-model", "input": "x", "max_output_tokens": 0}',
    b'{"model": "fake-model", "input": "x", "max_output_tokens": 2147483648}',
    b'{"model": "fake-model", "input": "x", "max_output_tokens": "5"}',
    b'{"model": "fake-model", "input": "x", "stream": "yes"}',
    b'{"model": "nope", "input": "x"}',
    b'{"model": "fake-model", "input": "x", "max_output_tokens": 101}',
    b'{"model": "fake-model", "input": "' + b"x" * 16000 + b'", "max_output_tokens": 100}',
    b'{"model": "fake-model", "input": "x", "stream": true}',
]


def _raw_post(body: bytes) -> bytes:
    head = (
        f"POST {RESPONSES} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


async def test_each_refused_body_is_refused_as_the_python_path_refuses_it() -> None:
    answers: list[list[bytes]] = []
    for native in paths():
        async with start_gateway(
            native=native,
            limits={"max_tokens": 100},
            streaming={"enabled": False},
        ) as h:
            replies = []
            for body in _BAD:
                reader, writer = await connect(h.url, _raw_post(body))
                replies.append(without_date(await asyncio.wait_for(reader.read(), 10)))
                writer.close()
            assert h.fake.seen == 0  # no backend saw any of them
            answers.append(replies)
    each_body = enumerate(zip(*answers, strict=True))
    pairs = [with_reference(list(replies), f"body {n}") for n, replies in each_body]
    native, python = ([pair[i] for pair in pairs] for i in (0, 1))
    for body, a, b in zip(_BAD, native, python, strict=True):
        assert a == b, body[:80]
        assert a.startswith((b"HTTP/1.1 400 ", b"HTTP/1.1 404 ")), a
    statuses = [int(a.split(b" ")[1]) for a in native]
    assert statuses.count(404) == 1
    codes = [json.loads(a.partition(b"\r\n\r\n")[2])["error"]["code"] for a in native]
    assert {
        "invalid_json",
        "invalid_request",
        "model_not_found",
        "max_tokens_too_large",
        "context_length_exceeded",
        "streaming_disabled",
    } <= set(codes)


async def test_a_refusal_with_retry_after_is_the_python_paths_byte_for_byte() -> None:
    held = _body(stream=True, fake={"step": True})
    answers = []
    for native, (raw, (status, _, headers)) in zip(
        paths(), await refused_on_both_paths(RESPONSES, held, _body()), strict=True
    ):
        assert (reply_id(raw) >= NATIVE_IDS) == native, raw
        assert status == 200
        assert by_front(headers) == native
        answers.append(re.sub(rb"llmflow-\d+", b"llmflow-ID", without_date(raw)))
    native, python = with_reference(answers)
    assert native.startswith(b"HTTP/1.1 429 ")
    assert b"retry-after: " in native.lower()
    assert native == python


async def test_a_client_that_leaves_mid_stream_frees_everything() -> None:
    async with start_gateway() as h:
        reader, writer = await connect(
            h.url, post(RESPONSES, _body(stream=True, fake={"step": True}))
        )
        await until(lambda: h.fake.running == 1)
        h.fake.release(1)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert reply_id(head) >= NATIVE_IDS
        await asyncio.wait_for(reader.readuntil(b"event: response.output_text.delta"), 5)
        assert h.gateway.runtime.running == 1  # the runtime holds its slot
        writer.close()
        await until(lambda: h.fake.aborted == 1)  # vLLM heard the abort
        await until(lambda: h.gateway.runtime.live == 0)
        assert h.fake.completed == 0
        await assert_idle(h)


async def test_a_streamed_response_keeps_the_connection_for_the_next_request() -> None:
    async with start_gateway() as h:
        first, second = _body(stream=True, max_output_tokens=3), _body(max_output_tokens=2)
        reader, writer = await connect(h.url, post(RESPONSES, first) + post(RESPONSES, second))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert reply_id(head) >= NATIVE_IDS
        streamed = await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)
        assert b"event: response.completed" in streamed
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        assert reply_id(head) >= NATIVE_IDS
        length = int(re.search(rb"content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        whole = json.loads(await asyncio.wait_for(reader.readexactly(length), 5))
        assert whole["status"] == "completed"
        writer.close()
        assert h.fake.completed == 2
        await assert_idle(h)


@pytest.mark.parametrize("mode", ["error", "degrade"])
@pytest.mark.parametrize("stream", [True, False], ids=["streamed", "whole"])
async def test_a_response_past_its_first_token_timeout_is_the_python_paths(
    mode: str, stream: bool
) -> None:
    streaming = {"first_token_timeout_ms": 200, "on_first_token_timeout": mode}
    body = _body(stream=stream, fake={"hang": True})
    if stream:
        native_reply, python_reply = await _dechunked_on_both_paths(body, streaming=streaming)
    else:
        native_reply, python_reply = await _whole_on_both_paths(body, streaming=streaming)
    assert native_reply == python_reply
    if mode == "error":
        assert native_reply.startswith(b"HTTP/1.1 504 ")
    elif stream:
        assert b'event: error\ndata: {"type":"error","code":"first_token_timeout"' in native_reply
    else:
        reply = json.loads(native_reply.partition(b"\r\n\r\n")[2])
        assert reply["incomplete_details"] == {"reason": "first_token_timeout"}


@on_each_path()
async def test_the_metrics_and_the_access_log_count_responses_on_either_path(
    tmp_path: Any, native: bool
) -> None:
    log = tmp_path / "access.csv"
    async with start_gateway(server={"access_log": str(log)}, native=native) as h:
        for stream in (True, False):
            r = await h.client.post(RESPONSES, json=_body(stream=stream))
            assert r.status_code == 200
            assert by_front(dict(r.headers)) == native
        await until(lambda: h.gateway.runtime.live == 0)
        metrics = (await h.client.get("/metrics")).text
        assert completed(metrics) == 2
        tokens = re.search(r"llmflow_tokens_streamed_total\{[^}]*\} (\S+)", metrics)
        assert tokens is not None
        assert float(tokens.group(1)) == 2 * 5  # counted from the deltas, as the fake sent
        rows = log.read_text().splitlines()
        assert len(rows) == 1 + 2
        header = rows[0].split(",")
        for row in rows[1:]:
            fields = dict(zip(header, row.split(","), strict=True))
            assert (fields["prompt_tokens"], fields["max_tokens"]) == ("1", "5")
            assert (fields["output_tokens"], fields["outcome"]) == ("5", "completed")


@on_each_path()
async def test_a_client_that_stops_reading_a_response_is_cut_for_its_stall(native: bool) -> None:
    big = _body(stream=True, max_output_tokens=3000, fake={"chunk_bytes": 16384})  # ~48 MB
    async with start_gateway(
        native=native, backpressure={"client_window": 4, "stall_timeout_ms": 600}
    ) as h:
        _reader, writer = await connect(h.url, post(RESPONSES, big))  # and never read
        try:
            await until(lambda: h.fake.aborted == 1, timeout_s=10)  # vLLM heard the abort
            assert h.fake.tokens_sent < 1000  # held back by the window, not 48 MB sent
            assert h.fake.completed == 0
            await until(lambda: h.gateway.metrics.outcomes["cancelled", "client_stall"] == 1)
            await until(lambda: h.gateway.runtime.live == 0)
            sent_id = h.fake.headers[-1]["x-request-id"]  # the id vLLM was sent
            assert (reply_id(f"x-request-id: {sent_id}".encode()) >= NATIVE_IDS) == native
        finally:
            writer.close()
        await assert_idle(h)

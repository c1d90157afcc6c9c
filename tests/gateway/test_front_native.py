"""The governed routes served natively by the front door, checked from outside.

A streamed completion the front is sure of never reaches Python: the front checks it, feeds
the shared runtime, and relays vLLM's stream itself. These tests check what a client and vLLM
see: the same bytes as the Python path (the app served alone, as the front passes it a request
it declines), one cap for the native
requests and the ones Python serves beside them, refusals byte for byte, departures that free
everything at vLLM, keep-alive and pipelining, and the metrics and trace counting them.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from typing import Any

import pytest
from websockets.asyncio.client import connect as ws_connect

from llmflow._core import replay_trace

from .both_paths import (
    by_front,
    completed,
    connect,
    on_each_path,
    paths,
    post,
    raw_on_both_paths,
    read_stream,
    refused_on_both_paths,
    streamed_on_both_paths,
    unsized,
    without_date,
)
from .goldens import with_reference
from .harness import (
    NATIVE_IDS,
    assert_idle,
    start_gateway,
    start_gateway_losing_its_backend,
    until,
)
from .test_relay import _comparable, _events

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"


def _body(path: str = CHAT, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "stream": True, "max_tokens": 5, **extra}
    if path.startswith(CHAT):
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CHAT, {}),
        (CHAT, {"stream_options": {"include_usage": True}}),
        (COMPLETIONS, {}),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}),
        (CHAT + "?api-version=2024-06-01", {}),  # a query, as Azure's clients send one
    ],
    ids=["chat", "chat-usage", "completions", "completions-usage", "chat-query"],
)
async def test_the_native_path_sends_what_the_python_path_sends(
    path: str, extra: dict[str, Any]
) -> None:
    replies = []
    for native in paths():
        async with start_gateway(native=native) as h:
            status, text, headers = await read_stream(h.client, path, _body(path, **extra))
            assert status == 200, text
            assert by_front(headers) == native
            assert headers["content-type"] == "text/event-stream; charset=utf-8"
            replies.append(_comparable(_events(text)))
            assert h.fake.completed == 1
            # vLLM got the same request either way: streamed, with continuous usage
            sent = h.fake.bodies[-1]
            assert sent["stream"] is True
            assert sent["stream_options"] == {
                "include_usage": True,
                "continuous_usage_stats": True,
            }
    native, python = with_reference(replies)
    assert native == python
    assert native[-1] == "[DONE]"


async def _over_websocket(url: str, body: dict[str, Any]) -> tuple[str, int]:
    """A completion over the WebSocket, which the app serves on the Python path: its end's
    reason and its request id (every chunk acknowledged as it comes)."""
    async with ws_connect(url.replace("http://", "ws://") + "/v1/ws") as ws:
        request = {"type": "request", "id": "r", "endpoint": "chat", "body": body}
        await ws.send(json.dumps(request))
        request_id = -1
        while True:
            message = json.loads(await asyncio.wait_for(ws.recv(), 10))
            if message["type"] == "start":
                request_id = message["request_id"]
            elif message["type"] == "chunk":
                await ws.send(json.dumps({"type": "ack", "id": "r", "seq": message["seq"]}))
            else:
                return message.get("reason", message["type"]), request_id


async def test_one_cap_holds_for_native_requests_and_those_python_serves_beside_them() -> None:
    cap = 2
    async with start_gateway(gate={"max_concurrency_per_gpu": cap}) as h:
        streamed = _body(max_tokens=8, fake={"itl": 0.01})
        # the WebSocket's completions: the app serves them, on the Python path
        over_ws = {k: v for k, v in streamed.items() if k != "stream"}
        results = await asyncio.gather(
            *(read_stream(h.client, CHAT, streamed) for _ in range(6)),
            *(_over_websocket(h.url, over_ws) for _ in range(6)),
        )
        native = results[:6]
        python: list[tuple[str, int]] = list(results[6:])  # type: ignore[arg-type]
        assert all(status == 200 and by_front(headers) for status, _, headers in native)
        assert all(reason == "completed" for reason, _ in python)
        assert not any(request_id >= NATIVE_IDS for _, request_id in python)
        assert h.fake.peak_running == cap  # the fake's own count, over both paths
        assert h.fake.completed == 12
        await assert_idle(h)


async def test_a_native_refusal_is_the_python_paths_refusal_byte_for_byte() -> None:
    answers = await refused_on_both_paths(CHAT, _body(fake={"step": True}), _body())
    # the ids differ by path (the front's range): compare the rest
    native, python = with_reference(
        [re.sub(rb"llmflow-\d+", b"llmflow-ID", without_date(a[0])) for a in answers]
    )
    assert native.startswith(b"HTTP/1.1 429 ")
    assert b"retry-after: " in native.lower()
    assert native == python


async def test_a_client_that_leaves_while_queued_or_mid_stream_frees_everything() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1}) as h:
        hold_reader, hold_writer = await connect(h.url, post(CHAT, _body(fake={"step": True})))
        await until(lambda: h.fake.running == 1)
        # queued behind it, then gone: vLLM never sees it
        _, queued_writer = await connect(h.url, post(CHAT, _body()))
        await until(lambda: h.gateway.runtime.queued == 1)
        queued_writer.close()
        await until(lambda: h.gateway.runtime.queued == 0)
        assert h.fake.seen == 1
        # mid-stream, gone: vLLM hears the abort
        h.fake.release(1)
        await hold_reader.readuntil(b"data: ")
        hold_writer.close()
        await until(lambda: h.fake.aborted == 1)
        await until(lambda: h.gateway.runtime.live == 0)
        await assert_idle(h)


async def test_keep_alive_and_a_pipelined_second_request_are_answered_in_order() -> None:
    async with start_gateway() as h:
        first, second = _body(max_tokens=3), _body(COMPLETIONS, max_tokens=4)
        reader, writer = await connect(h.url, post(CHAT, first) + post(COMPLETIONS, second))
        texts = []
        for _ in range(2):
            head = await reader.readuntil(b"\r\n\r\n")
            assert head.startswith(b"HTTP/1.1 200 ")
            body = await reader.readuntil(b"0\r\n\r\n")  # the chunked reply's end
            texts.append(body.decode())
        writer.close()
        assert "chat.completion.chunk" in texts[0]
        assert '"text_completion"' in texts[1]
        assert h.fake.completed == 2
        await assert_idle(h)


@on_each_path()
async def test_the_metrics_and_the_access_log_count_requests_on_either_path(
    tmp_path: Any, native: bool
) -> None:
    log = tmp_path / "access.csv"
    async with start_gateway(
        server={"access_log": str(log)}, native=native,
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
    ) as h:
        hold = asyncio.create_task(read_stream(h.client, CHAT, _body(fake={"step": True})))
        await until(lambda: h.fake.running == 1)
        status, _, _ = await read_stream(h.client, CHAT, _body())
        assert status == 429
        h.fake.release(10)
        await hold
        for _ in range(3):
            status, _, headers = await read_stream(h.client, CHAT, _body())
            assert status == 200
            assert by_front(headers) == native
        await until(lambda: h.gateway.runtime.live == 0)
        metrics = (await h.client.get("/metrics")).text
        assert completed(metrics) == 4
        assert "llmflow_ttft_seconds_count" in metrics
        rows = log.read_text().splitlines()
        assert len(rows) == 1 + 5  # the header, four served, one refused
        assert sum(",rejected," in row for row in rows) == 1


async def test_a_trace_of_native_requests_replays_bit_for_bit() -> None:
    trace = io.StringIO()
    async with start_gateway(trace=trace, gate={"max_concurrency_per_gpu": 2}) as h:
        results = await asyncio.gather(*(read_stream(h.client, CHAT, _body()) for _ in range(6)))
        assert all(status == 200 and by_front(headers) for status, _, headers in results)
        await until(lambda: h.gateway.runtime.live == 0)
    # the gateway has stopped: its trace is flushed
    events, actions = replay_trace(trace.getvalue())
    assert events >= 6 * 3  # each request's arrive, started and done at least
    assert actions >= 6 * 2  # each one's start and end at least


# ---- replies not streamed: assembled from the upstream stream ------------------------------


def _whole_body(path: str = CHAT, **extra: Any) -> dict[str, Any]:
    return {**_body(path, **extra), "stream": False}


def _wire(raw: bytes) -> bytes:
    """A reply as it went on the wire, less what differs by path or by run: the date, the
    request ids (the front numbers from its own range), the `created` clock; its
    `content-length` checked against the body it heads, then left out (the ids' lengths
    differ)."""
    head, _, body = unsized(raw).partition(b"\r\n\r\n")
    head = without_date(head)
    body = re.sub(rb'"created":\d+', b'"created":0', body)
    return re.sub(rb"llmflow-\d+", b"llmflow-ID", head + b"\r\n\r\n" + body)


async def _whole_on_both_paths(
    path: str,
    body: dict[str, Any],
    steps: int | None = None,
    unstreamed: bool = False,
    **sections: Any,
) -> list[bytes]:
    """The raw reply to `body`, not streamed, from the native front, masked, and its reference:
    the Python path's (the app alone), or its golden once it is gone (`with_reference`);
    `steps`: the fake emits that many tokens, then holds the rest; `unstreamed`: the request
    asks what vLLM computes only unstreamed (prompt logprobs)."""
    replies = []
    for raw, sent in await raw_on_both_paths(path, body, steps, **sections):
        if sent and unstreamed:  # sent as the client sent it, either way
            assert sent["stream"] is False
            assert "stream_options" not in sent
        elif sent:  # vLLM was asked for a stream, with continuous usage, either way
            assert sent["stream"] is True
            assert sent["stream_options"]["continuous_usage_stats"] is True
        replies.append(_wire(raw))
    return list(with_reference(replies))


@pytest.mark.parametrize(
    ("path", "extra"),
    [(CHAT, {}), (COMPLETIONS, {}), (CHAT, {"max_tokens": 1}), (COMPLETIONS, {"echo": False})],
    ids=["chat", "completions", "chat-one-token", "completions-no-echo"],
)
async def test_a_whole_reply_is_the_python_paths_byte_for_byte(
    path: str, extra: dict[str, Any]
) -> None:
    native, python = await _whole_on_both_paths(path, _whole_body(path, **extra))
    assert native == python
    head, _, body = native.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    reply = json.loads(body)
    assert reply["usage"]["completion_tokens"] == extra.get("max_tokens", 5)
    assert "llmflow" not in reply


async def test_a_whole_reply_cut_by_its_deadline_is_the_python_paths() -> None:
    # Two tokens come, then the fake holds the rest until the total deadline cuts the reply.
    body = _whole_body(max_tokens=50, fake={"step": True})
    native, python = await _whole_on_both_paths(CHAT, body, steps=2, timeouts={"total_ms": 400})
    assert native == python
    head, _, text = native.partition(b"\r\n\r\n")
    assert b"\r\nx-llmflow-reason: deadline" in head
    reply = json.loads(text)
    assert reply["choices"][0]["message"]["content"].startswith("t0 t1 \n\n[llmflow: reply")
    assert reply["llmflow"] == {"truncated": True, "reason": "deadline"}


@pytest.mark.parametrize(
    "fake",
    [
        {"status": 500},
        {"status": 400},
        {"error_after": 2},
        {"error_after": 1, "error_param": "logprobs"},
        {"crash_after": 2},
    ],
    ids=["500", "400", "in-band-500", "in-band-400", "crash"],
)
async def test_an_upstream_failure_of_a_whole_reply_is_the_python_paths(
    fake: dict[str, Any],
) -> None:
    """vLLM's own error object (its 4xx) keeps its keys' order; a connection that breaks under
    the reply is worded as Python's upstream words what its client raised."""
    body = _whole_body(fake=fake)
    native, python = await _whole_on_both_paths(CHAT, body, check_idle=False)
    assert not native.startswith(b"HTTP/1.1 200 ")
    if "crash_after" in fake:
        assert re.search(rb'"message":"backend stream broke: (ConnectionLost|[A-Z][a-z ]+)"',
                         native), native
    assert native == python


@pytest.mark.parametrize("mode", ["error", "degrade"])
async def test_a_whole_reply_past_its_first_token_timeout_is_the_python_paths(mode: str) -> None:
    streaming = {"first_token_timeout_ms": 200, "on_first_token_timeout": mode}
    body = _whole_body(COMPLETIONS, fake={"hang": True})
    native, python = await _whole_on_both_paths(COMPLETIONS, body, streaming=streaming)
    assert native == python
    if mode == "error":
        assert native.startswith(b"HTTP/1.1 504 ")
    else:
        head, _, text = native.partition(b"\r\n\r\n")
        assert b"\r\nx-llmflow-reason: first_token_timeout" in head
        assert json.loads(text)["choices"][0]["text"].startswith("[llmflow: the model did not")


async def test_a_client_that_leaves_before_its_whole_reply_frees_everything() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1}) as h:
        _, writer = await connect(h.url, post(CHAT, _whole_body(fake={"step": True})))
        await until(lambda: h.fake.running == 1)
        h.fake.release(2)
        await until(lambda: h.fake.tokens_sent == 2)
        writer.close()
        await until(lambda: h.fake.aborted == 1)
        await until(lambda: h.gateway.runtime.live == 0)
        # the slot is free again: the next one is served whole, natively
        r = await h.client.post(CHAT, json=_whole_body(max_tokens=3))
        assert r.status_code == 200
        assert by_front(dict(r.headers))
        assert r.json()["choices"][0]["message"]["content"] == "t0 t1 t2 "
        await assert_idle(h)


async def test_a_whole_reply_keeps_the_connection_for_a_pipelined_next_request() -> None:
    async with start_gateway() as h:
        first, second = _whole_body(max_tokens=2), _body(COMPLETIONS, max_tokens=3)
        reader, writer = await connect(h.url, post(CHAT, first) + post(COMPLETIONS, second))
        head = await reader.readuntil(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ")
        length = int(re.search(rb"content-length: (\d+)", head).group(1))  # type: ignore[union-attr]
        whole = json.loads(await reader.readexactly(length))
        assert whole["object"] == "chat.completion"
        assert whole["choices"][0]["message"]["content"] == "t0 t1 "
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"text/event-stream" in head
        assert '"text_completion"' in (await reader.readuntil(b"0\r\n\r\n")).decode()
        writer.close()
        assert h.fake.completed == 2
        await assert_idle(h)


async def test_an_unreachable_backend_is_502_then_503_on_the_native_path() -> None:
    """vLLM gone after the gateway started: the relay's connect is refused, the request gets
    502 backend_unavailable, the backend is marked down by that request, and the next one
    gets 503 no_healthy_backend with a Retry-After; nothing stays held."""
    async with start_gateway_losing_its_backend() as h:
        gateway = h.gateway
        for stream, status, code in (
            (True, 502, "backend_unavailable"),
            (False, 503, "no_healthy_backend"),
        ):
            r = await h.client.post(CHAT, json={**_body(), "stream": stream})
            assert by_front(dict(r.headers)), r.headers
            assert (r.status_code, r.json()["error"]["code"]) == (status, code), r.text
            if status == 502:
                state = gateway.scraper.states["b0"]
                await until(lambda state=state: not state.healthy)  # the request marked it
                await until(lambda state=state: state.failures >= 1)  # no scrape revives it
        assert int(r.headers["retry-after"]) >= 1
        await until(lambda: gateway.runtime.live == 0)
        assert (gateway.runtime.running, gateway.runtime.queued) == (0, 0)
        assert h.fake.seen == 0


async def test_every_token_a_client_reads_reaches_the_runtime_before_its_end() -> None:
    # The relay tallies a stream's tokens and hands them over in batches: the trace (what
    # the runtime was fed) must still hold every token the client read, all before its Done.
    trace = io.StringIO()
    async with start_gateway(trace=trace) as h:
        body = _body(max_tokens=30, fake={"itl": 0.002})
        results = await asyncio.gather(*(read_stream(h.client, CHAT, body) for _ in range(3)))
        await until(lambda: h.gateway.runtime.live == 0)
    read: dict[int, int] = {}
    for status, text, headers in results:
        assert status == 200
        assert by_front(headers)
        chunks = [e for e in _events(text) if isinstance(e, dict)]
        read[int(headers["x-request-id"].removeprefix("llmflow-"))] = sum(
            1 for c in chunks for choice in c["choices"] if choice["delta"].get("content")
        )
    assert sorted(read.values()) == [30, 30, 30]
    fed: dict[int, int] = dict.fromkeys(read, 0)
    done: set[int] = set()
    for line in trace.getvalue().splitlines()[1:]:  # after the header (the config)
        event = json.loads(line)["ev"]
        if not isinstance(event, dict):
            continue
        if "tokens" in event and event["tokens"]["id"] in fed:
            assert event["tokens"]["id"] not in done, "tokens fed after the request's Done"
            fed[event["tokens"]["id"]] += event["tokens"]["n"]
        elif "done" in event:
            done.add(event["done"]["id"])
    assert fed == read
    assert done == set(read)


@on_each_path()
async def test_a_stream_cut_by_its_deadline_keeps_the_connection(native: bool) -> None:
    """The cut ends the reply whole (notice, `[DONE]`, last chunk) and promised no close: the
    connection serves the client's next request, on either path (a client's pool reuses it)."""
    async with start_gateway(native=native, timeouts={"total_ms": 300}) as h:
        held = _body(max_tokens=50, fake={"step": True})
        reader, writer = await connect(h.url, post(CHAT, held))
        h.fake.release(2)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert b"connection: close" not in head.lower()
        cut = (await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)).decode()
        assert '"reason":"deadline"' in cut
        assert "data: [DONE]" in cut
        h.fake.release(100)  # let the fake's own task end
        writer.write(post(COMPLETIONS, _body(COMPLETIONS, max_tokens=2)))
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 "), head
        request_id = re.search(r"llmflow-\d+", head.decode()).group()  # type: ignore[union-attr]
        assert by_front({"x-request-id": request_id}) == native
        await asyncio.wait_for(reader.readuntil(b"\r\n0\r\n\r\n"), 5)
        writer.close()
        await assert_idle(h)


# ---- several choices and continuous usage --------------------------------------------------


def _sse_body(text: str) -> str:
    """A streamed reply's body less what differs by run: the `created` clock."""
    return re.sub(r'"created":\d+', '"created":0', text)


async def _streams_on_both_paths(
    path: str, body: dict[str, Any], steps: int | None = None, **sections: Any
) -> list[str]:
    """The body of the streamed reply to `body` from the native front, masked, and its
    reference: the Python path's (the app alone), or its golden once it is gone
    (`with_reference`); each checked to be served where it should; `steps`: the fake emits
    that many steps, then holds the rest."""
    replies = []
    for text, _, sent in await streamed_on_both_paths(path, body, steps, **sections):
        # vLLM streamed it either way, with continuous usage
        assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        replies.append(_sse_body(text))
    return list(with_reference(replies))


def _chunks(text: str) -> list[dict[str, Any]]:
    return [e for e in _events(text) if isinstance(e, dict)]


_BOTH = {"include_usage": True, "continuous_usage_stats": True}


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CHAT, {"n": 2}),
        (CHAT, {"n": 3, "fake": {"choice_tokens": [2, 5, 3]}}),
        (CHAT, {"n": 2, "stream_options": {"include_usage": True}}),
        (COMPLETIONS, {"n": 2, "fake": {"choice_tokens": [4, 1]}}),
        (COMPLETIONS, {"prompt": ["hi", "there"], "n": 2}),
        (CHAT, {"stream_options": _BOTH}),
        (CHAT, {"stream_options": {"continuous_usage_stats": True}}),
        (COMPLETIONS, {"stream_options": _BOTH}),
        (CHAT, {"n": 2, "stream_options": _BOTH, "fake": {"choice_tokens": [1, 3]}}),
    ],
    ids=[
        "chat-n2", "chat-n3-uneven", "chat-n2-usage", "completions-n2-uneven", "prompt-list",
        "chat-continuous", "chat-continuous-no-usage-chunk", "completions-continuous",
        "chat-n2-continuous",
    ],
)
async def test_several_choices_and_continuous_usage_stream_natively_as_python_sends_them(
    path: str, extra: dict[str, Any]
) -> None:
    native, python = await _streams_on_both_paths(path, {**_body(path), **extra})
    assert native == python
    chunks = _chunks(native)
    options = extra.get("stream_options", {})
    n = extra.get("n", 1) * len(extra.get("prompt", [""]))
    finished = [c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"]]
    assert sorted(finished) == list(range(n))  # every choice ends, once
    with_usage = [chunk for chunk in chunks if chunk.get("usage")]
    if options.get("continuous_usage_stats"):
        # every chunk states the tokens so far, and the tallies only grow
        assert all(chunk.get("usage") for chunk in chunks)
        tallies = [chunk["usage"]["completion_tokens"] for chunk in chunks]
        assert tallies == sorted(tallies)
    else:
        assert all(not chunk["choices"] for chunk in with_usage)
    usage_chunk = [chunk for chunk in chunks if not chunk["choices"]]
    assert len(usage_chunk) == (1 if options.get("include_usage") else 0)
    if usage_chunk:
        counts = extra.get("fake", {}).get("choice_tokens") or [5] * n
        assert usage_chunk[0]["usage"]["completion_tokens"] == sum(counts)


async def test_a_cut_names_the_choices_still_open_on_the_native_path_as_on_pythons() -> None:
    # Choice 0 finishes at its first token; two steps come, then the deadline cuts 1 and 2.
    body = _body(max_tokens=50, n=3, fake={"step": True, "choice_tokens": [1, 50, 50]})
    native, python = await _streams_on_both_paths(CHAT, body, steps=2, timeouts={"total_ms": 400})
    assert native == python
    chunks = _chunks(native)
    tail = chunks[-1]
    assert tail["llmflow"] == {"truncated": True, "reason": "deadline"}
    assert [c["index"] for c in tail["choices"]] == [1, 2]
    assert all(c["delta"]["content"].startswith("\n\n[llmflow: reply") for c in tail["choices"])
    # choice 0's own finishing chunk came before the notice, with no notice of its own
    zero = [c for chunk in chunks for c in chunk["choices"] if c["index"] == 0]
    assert [c["finish_reason"] for c in zero if c["finish_reason"]] == ["length"]


async def test_a_cut_after_every_choice_finished_is_no_truncation_on_either_path() -> None:
    # Both choices finish at the first step; the stream stays open (no [DONE] yet) until the
    # deadline cuts it: nothing was truncated, so no notice and no truncation counted.
    body = _body(max_tokens=50, n=2, fake={"step": True, "choice_tokens": [1, 1],
                                           "hold_done": True})
    replies, counted = [], []
    for native in paths():
        async with start_gateway(native=native, timeouts={"total_ms": 400}) as h:
            request = asyncio.create_task(read_stream(h.client, CHAT, body))
            await until(lambda h=h: h.fake.running == 1)
            h.fake.release(1)
            status, text, headers = await asyncio.wait_for(request, 10)
            assert status == 200, text
            assert by_front(headers) == native
            h.fake.release(100)
            await until(lambda h=h: h.gateway.runtime.live == 0)
            await asyncio.sleep(0.25)  # the native front's records reach the metrics
            metrics = (await h.client.get("/metrics")).text
            counted.append(re.findall(r"^llmflow_truncations_total\{.*\} (\S+)$", metrics, re.M))
            replies.append(_sse_body(text))
    replies = list(with_reference(replies))
    assert replies[0] == replies[1]
    assert not any("llmflow" in chunk for chunk in _chunks(replies[0]))
    assert counted == [[]] * len(paths())


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CHAT, {"n": 2}),
        (CHAT, {"n": 3, "fake": {"choice_tokens": [2, 5, 3]}}),
        (COMPLETIONS, {"n": 2, "fake": {"choice_tokens": [4, 1]}}),
        (COMPLETIONS, {"prompt": ["hi", "there", "you"]}),
        (CHAT, {"n": 2, "stream_options": None}),
    ],
    ids=["chat-n2", "chat-n3-uneven", "completions-n2-uneven", "prompt-list", "chat-n2-null"],
)
async def test_a_whole_reply_of_several_choices_is_the_python_paths_byte_for_byte(
    path: str, extra: dict[str, Any]
) -> None:
    native, python = await _whole_on_both_paths(path, {**_whole_body(path), **extra})
    assert native == python
    head, _, body = native.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    reply = json.loads(body)
    n = extra.get("n", 1) * len(extra.get("prompt", [""]))
    counts = extra.get("fake", {}).get("choice_tokens") or [5] * n
    assert [c["index"] for c in reply["choices"]] == list(range(n))
    for choice, count in zip(reply["choices"], counts, strict=True):
        text = choice["message"]["content"] if path == CHAT else choice["text"]
        assert text == "".join(f"t{i} " for i in range(count))
        assert choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == sum(counts)


async def test_a_whole_reply_of_several_choices_cut_by_its_deadline_is_the_python_paths() -> None:
    # Choice 1 finishes at its first token; two steps come, then the deadline cuts 0 and 2.
    body = _whole_body(max_tokens=50, n=3, fake={"step": True, "choice_tokens": [50, 1, 50]})
    native, python = await _whole_on_both_paths(CHAT, body, steps=2, timeouts={"total_ms": 400})
    assert native == python
    head, _, text = native.partition(b"\r\n\r\n")
    assert b"\r\nx-llmflow-reason: deadline" in head
    reply = json.loads(text)
    contents = [c["message"]["content"] for c in reply["choices"]]
    assert contents[1] == "t0 "
    assert contents[0].startswith("t0 t1 \n\n[llmflow: reply")
    assert contents[2].startswith("t0 t1 \n\n[llmflow: reply")
    assert reply["llmflow"] == {"truncated": True, "reason": "deadline"}


# ---- prompt logprobs: asked of vLLM unstreamed -----------------------------------------------


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (COMPLETIONS, {"prompt_logprobs": 1}),
        (COMPLETIONS, {"echo": True, "logprobs": 2}),
        (CHAT, {"prompt_logprobs": 1}),
    ],
    ids=["completions", "echo", "chat"],
)
async def test_an_unstreamed_answer_is_the_python_paths_byte_for_byte(
    path: str, extra: dict[str, Any]
) -> None:
    native, python = await _whole_on_both_paths(
        path, {**_whole_body(path), **extra}, unstreamed=True
    )
    assert native == python
    head, _, body = native.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 OK\r\n")
    reply = json.loads(body)
    assert reply["fake_whole"] is True  # vLLM's own answer, every field of it
    assert reply["choices"][0]["prompt_logprobs"] == [None, {"7": -1.5}]
    assert reply["usage"]["completion_tokens"] == 5


async def test_an_unstreamed_answer_cut_by_its_deadline_is_the_python_paths() -> None:
    # vLLM takes 2 s to answer; the total deadline cuts the request at 300 ms: the reply is
    # the notice for every choice, on either path.
    body = {**_whole_body(COMPLETIONS, n=2, fake={"ttft": 2}), "prompt_logprobs": 1}
    native, python = await _whole_on_both_paths(
        COMPLETIONS, body, unstreamed=True, timeouts={"total_ms": 300}
    )
    assert native == python
    head, _, text = native.partition(b"\r\n\r\n")
    assert b"\r\nx-llmflow-reason: deadline" in head
    reply = json.loads(text)
    assert [c["index"] for c in reply["choices"]] == [0, 1]
    assert all(c["text"].startswith("\n\n[llmflow: reply") for c in reply["choices"])


async def test_an_unstreamed_answer_counts_its_tokens_and_frees_everything() -> None:
    trace = io.StringIO()
    async with start_gateway(trace=trace) as h:
        body = {**_whole_body(COMPLETIONS, max_tokens=7), "prompt_logprobs": 1}
        r = await h.client.post(COMPLETIONS, json=body)
        assert r.status_code == 200, r.text
        assert by_front(dict(r.headers))
        await until(lambda: h.gateway.runtime.live == 0)
        await assert_idle(h)
    fed = [json.loads(line)["ev"] for line in trace.getvalue().splitlines()[1:]]
    tokens = [e["tokens"]["n"] for e in fed if isinstance(e, dict) and "tokens" in e]
    assert tokens == [7]  # all at once, from the answer's usage


async def test_a_client_that_leaves_before_its_unstreamed_answer_frees_everything() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1}) as h:
        body = {**_whole_body(COMPLETIONS, fake={"ttft": 0.5}), "prompt_logprobs": 1}
        _, writer = await connect(h.url, post(COMPLETIONS, body))
        await until(lambda: h.fake.running == 1)
        writer.close()
        await until(lambda: h.gateway.runtime.live == 0)
        assert h.gateway.runtime.running == 0  # the slot is free before vLLM answers
        # the next one takes it, natively, and gets vLLM's answer
        r = await h.client.post(COMPLETIONS, json={**body, "fake": {}})
        assert r.status_code == 200, r.text
        assert by_front(dict(r.headers))
        assert r.json()["choices"][0]["prompt_logprobs"] == [None, {"7": -1.5}]
        await until(lambda: h.fake.running == 0)
        await assert_idle(h)

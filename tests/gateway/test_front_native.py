"""The governed routes served natively by the front door, checked from outside.

A streamed completion the front is sure of never reaches Python: the front checks it, feeds
the shared runtime, and relays vLLM's stream itself. These tests check what a client and vLLM
see: the same bytes as the Python path (`server.relay: false`: the front passes every request
to the app), one cap for the native
requests and the ones Python serves beside them, refusals byte for byte, departures that free
everything at vLLM, keep-alive and pipelining, and the metrics and trace counting them.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import pytest

from llmflow._core import replay_trace

from .harness import assert_idle, start_gateway, until
from .test_relay import _comparable, _events

if TYPE_CHECKING:
    import httpx

pytestmark = pytest.mark.anyio
CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
NATIVE_IDS = 1 << 40  # the front numbers its requests from here (`front/owner.rs`)


def _body(path: str = CHAT, **extra: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "fake-model", "stream": True, "max_tokens": 5, **extra}
    if path == CHAT:
        body["messages"] = [{"role": "user", "content": "hi"}]
    else:
        body["prompt"] = "hi"
    return body


async def _stream(
    client: httpx.AsyncClient, path: str, body: dict[str, Any]
) -> tuple[int, str, dict[str, str]]:
    async with client.stream("POST", path, json=body) as r:
        text = (await r.aread()).decode()
        return r.status_code, text, dict(r.headers)


def _native(headers: dict[str, str]) -> bool:
    """Whether the front served it (its id is from the front's range)."""
    return int(headers["x-request-id"].removeprefix("llmflow-")) >= NATIVE_IDS


async def _raw(url: str, payload: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    parts = urlsplit(url)
    reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
    writer.write(payload)
    await writer.drain()
    return reader, writer


def _post(path: str, body: dict[str, Any], close: bool = False) -> bytes:
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"content-length: {len(data)}\r\n"
    )
    if close:
        head += "connection: close\r\n"
    return head.encode() + b"\r\n" + data


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        (CHAT, {}),
        (CHAT, {"stream_options": {"include_usage": True}}),
        (COMPLETIONS, {}),
        (COMPLETIONS, {"stream_options": {"include_usage": True}}),
    ],
)
async def test_the_native_path_sends_what_the_python_path_sends(
    path: str, extra: dict[str, Any]
) -> None:
    replies = []
    for native in (True, False):
        async with start_gateway(server={"relay": native}) as h:
            status, text, headers = await _stream(h.client, path, _body(path, **extra))
            assert status == 200, text
            assert _native(headers) == native
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
    native, python = replies
    assert native == python
    assert native[-1] == "[DONE]"


async def test_one_cap_holds_for_native_requests_and_those_python_serves_beside_them() -> None:
    cap = 2
    async with start_gateway(gate={"max_concurrency_per_gpu": cap}) as h:
        streamed = _body(max_tokens=8, fake={"itl": 0.01})
        whole = {**streamed, "stream": False}  # not streamed: the front passes it to Python
        results = await asyncio.gather(
            *(_stream(h.client, CHAT, streamed) for _ in range(6)),
            *(h.client.post(CHAT, json=whole) for _ in range(6)),
        )
        native = results[:6]
        python: list[httpx.Response] = list(results[6:])  # type: ignore[arg-type]
        assert all(status == 200 and _native(headers) for status, _, headers in native)
        assert all(r.status_code == 200 for r in python)
        assert not any(_native(dict(r.headers)) for r in python)
        assert h.fake.peak_running == cap  # the fake's own count, over both paths
        assert h.fake.completed == 12
        await assert_idle(h)


def _without_date(raw: bytes) -> bytes:
    return re.sub(rb"\r\ndate: [^\r]*", b"", raw)


async def test_a_native_refusal_is_the_python_paths_refusal_byte_for_byte() -> None:
    answers = []
    for native in (True, False):
        async with start_gateway(
            server={"relay": native},
            gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
        ) as h:
            hold = asyncio.create_task(_stream(h.client, CHAT, _body(fake={"step": True})))
            await until(lambda h=h: h.fake.running == 1)
            reader, writer = await _raw(h.url, _post(CHAT, _body(), close=True))
            raw = await reader.read()
            writer.close()
            h.fake.release(10)
            await hold
            # the ids differ by path (the front's range): compare the rest
            answers.append(re.sub(rb"llmflow-\d+", b"llmflow-ID", _without_date(raw)))
    native, python = answers
    assert native.startswith(b"HTTP/1.1 429 ")
    assert b"retry-after: " in native.lower()
    assert native == python


async def test_a_client_that_leaves_while_queued_or_mid_stream_frees_everything() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1}) as h:
        hold_reader, hold_writer = await _raw(h.url, _post(CHAT, _body(fake={"step": True})))
        await until(lambda: h.fake.running == 1)
        # queued behind it, then gone: vLLM never sees it
        _, queued_writer = await _raw(h.url, _post(CHAT, _body()))
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
        reader, writer = await _raw(h.url, _post(CHAT, first) + _post(COMPLETIONS, second))
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


@pytest.mark.parametrize("native", [True, False], ids=["native", "python"])
async def test_the_metrics_and_the_access_log_count_requests_on_either_path(
    tmp_path: Any, native: bool
) -> None:
    log = tmp_path / "access.csv"
    async with start_gateway(
        server={"access_log": str(log), "relay": native},
        gate={"max_concurrency_per_gpu": 1, "queue": {"max_waiting": 0}},
    ) as h:
        hold = asyncio.create_task(_stream(h.client, CHAT, _body(fake={"step": True})))
        await until(lambda: h.fake.running == 1)
        status, _, _ = await _stream(h.client, CHAT, _body())
        assert status == 429
        h.fake.release(10)
        await hold
        for _ in range(3):
            status, _, headers = await _stream(h.client, CHAT, _body())
            assert status == 200
            assert _native(headers) == native
        await until(lambda: h.gateway.runtime.live == 0)
        metrics = (await h.client.get("/metrics")).text
        completed = re.search(r'llmflow_requests_total\{[^}]*outcome="completed"[^}]*\} (\S+)',
                              metrics)
        assert completed is not None
        assert float(completed.group(1)) == 4
        assert "llmflow_ttft_seconds_count" in metrics
        rows = log.read_text().splitlines()
        assert len(rows) == 1 + 5  # the header, four served, one refused
        assert sum(",rejected," in row for row in rows) == 1


async def test_a_trace_of_native_requests_replays_bit_for_bit() -> None:
    trace = io.StringIO()
    async with start_gateway(
        trace=trace, gate={"max_concurrency_per_gpu": 2}
    ) as h:
        results = await asyncio.gather(*(_stream(h.client, CHAT, _body()) for _ in range(6)))
        assert all(status == 200 and _native(headers) for status, _, headers in results)
        await until(lambda: h.gateway.runtime.live == 0)
    # the gateway has stopped: its trace is flushed
    events, actions = replay_trace(trace.getvalue())
    assert events >= 6 * 3  # each request's arrive, started and done at least
    assert actions >= 6 * 2  # each one's start and end at least


async def test_every_token_a_client_reads_reaches_the_runtime_before_its_end() -> None:
    # The relay tallies a stream's tokens and hands them over in batches: the trace (what
    # the runtime was fed) must still hold every token the client read, all before its Done.
    trace = io.StringIO()
    async with start_gateway(trace=trace) as h:
        body = _body(max_tokens=30, fake={"itl": 0.002})
        results = await asyncio.gather(*(_stream(h.client, CHAT, body) for _ in range(3)))
        await until(lambda: h.gateway.runtime.live == 0)
    read: dict[int, int] = {}
    for status, text, headers in results:
        assert status == 200
        assert _native(headers)
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

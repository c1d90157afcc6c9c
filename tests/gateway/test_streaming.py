"""SSE passthrough, coalescing, first-token timeout and the total deadline's truncation."""

from __future__ import annotations

from typing import Any

import openai
import pytest

from llmflow.gateway.streaming import notice_for

from .harness import Harness, start_gateway, until
from .sse_client import frames, text_of

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"


def _chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


async def test_each_chunk_is_forwarded_before_the_next_is_generated(gw: Harness) -> None:
    gw.fake.release()  # the first token: the status goes out with it
    async with gw.client.stream("POST", CHAT, json=_chat(max_tokens=4, fake={"step": True})) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        it = frames(r)
        assert text_of([await anext(it), await anext(it)]) == "t0 "
        for i in range(1, 4):
            assert gw.fake.tokens_sent == i
            gw.fake.release()
            assert text_of([await anext(it)]) == f"t{i} "
        assert await anext(it) == "[DONE]"


async def test_coalescing_merges_a_burst_into_fewer_valid_chunks() -> None:
    async with start_gateway(streaming={"sse_flush_interval": "200ms"}) as h:
        async with h.client.stream("POST", CHAT, json=_chat(max_tokens=40, fake={"itl": 0})) as r:
            chunks = [c async for c in frames(r)]
        assert chunks[-1] == "[DONE]"
        body = chunks[:-1]
        assert text_of(body) == "".join(f"t{i} " for i in range(40))
        assert len(body) < 20  # 41 upstream chunks in a burst, flushed at most every 200 ms
        assert body[-1]["choices"][0]["finish_reason"] == "length"
        assert all(c["object"] == "chat.completion.chunk" and c["choices"] for c in body)
        async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="k", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model="fake-model",
                messages=[{"role": "user", "content": "hi"}],
                max_tokens=40,
                stream=True,
                extra_body={"fake": {"itl": 0}},
            )
            parsed = [chunk async for chunk in stream]
        assert "".join(ch.choices[0].delta.content or "" for ch in parsed) == text_of(body)


async def test_deadline_cuts_a_stream_with_notice_and_marker_and_aborts_upstream() -> None:
    async with start_gateway(timeouts={"total_ms": 400}) as h:
        async with h.client.stream(
            "POST", CHAT, json=_chat(max_tokens=500, fake={"itl": 0.02})
        ) as r:
            chunks = [c async for c in frames(r)]
        await h.settle()
        assert chunks[-1] == "[DONE]"
        tail = chunks[-2]
        assert tail["llmflow"] == {"truncated": True, "reason": "deadline"}
        assert tail["choices"] == [
            {
                "index": 0,
                "delta": {"content": notice_for("deadline")},
                "logprobs": None,
                "finish_reason": "length",
            }
        ]
        text = text_of(chunks[:-2])
        assert text.startswith("t0 t1 ")
        assert len(text) < 500 * 3
        await until(lambda: h.fake.aborted == 1)
        assert h.fake.completed == 0
        assert h.fake.tokens_sent < 40  # ~0.4 s of 20 ms tokens: it stopped generating


async def test_deadline_non_streaming_returns_partial_text_and_notice() -> None:
    async with start_gateway(timeouts={"total_ms": 300}) as h:
        r = await h.client.post(CHAT, json=_chat(stream=False, max_tokens=500, fake={"itl": 0.02}))
        body = r.json()
        assert r.status_code == 200
        content = body["choices"][0]["message"]["content"]
        assert content.startswith("t0 t1 ")
        assert content.endswith(notice_for("deadline"))
        assert body["choices"][0]["finish_reason"] == "length"
        assert body["llmflow"] == {"truncated": True, "reason": "deadline"}
        await h.settle()
        assert h.fake.aborted == 1


@pytest.mark.parametrize("stream", [True, False])
async def test_first_token_timeout_degrades_to_a_notice(stream: bool) -> None:
    async with start_gateway(
        streaming={"first_token_timeout_ms": 150, "on_first_token_timeout": "degrade"}
    ) as h:
        r = await h.client.post(CHAT, json=_chat(stream=stream, fake={"hang": True}))
        assert r.status_code == 200
        if stream:
            chunks = [c async for c in frames(r)]
            assert chunks[-1] == "[DONE]"
            marker, text = chunks[-2]["llmflow"], text_of(chunks)
        else:
            marker, text = r.json()["llmflow"], r.json()["choices"][0]["message"]["content"]
        assert marker == {"truncated": True, "reason": "first_token_timeout"}
        assert text == notice_for("first_token_timeout")
        await h.settle()
        assert h.fake.aborted == 1


async def test_backend_crash_mid_stream_ends_with_an_in_band_error(gw: Harness) -> None:
    async with gw.client.stream(
        "POST", CHAT, json=_chat(max_tokens=10, fake={"crash_after": 3})
    ) as r:
        chunks = [c async for c in frames(r)]
    assert text_of(chunks) == "t0 t1 t2 "
    assert chunks[-1] == "[DONE]"
    assert chunks[-2]["error"]["code"] == "backend_error"
    # The fake closes the connection mid-body: Python's client raises ConnectionLost, and the
    # native front words it the same.
    assert chunks[-2]["error"]["message"] == "backend stream broke: ConnectionLost"


async def test_backend_crash_before_any_token_is_502(gw: Harness) -> None:
    r = await gw.client.post(CHAT, json=_chat(max_tokens=10, fake={"crash_after": 0}))
    assert r.status_code == 502

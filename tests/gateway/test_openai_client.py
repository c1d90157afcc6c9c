"""The unmodified `openai` client against the gateway: chat and completions, streamed and not."""

from __future__ import annotations

from typing import TYPE_CHECKING

import openai
import pytest

if TYPE_CHECKING:
    from .harness import Harness

pytestmark = pytest.mark.anyio


def _client(gw: Harness, key: str = "unused") -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0)


async def test_chat_streaming_delivers_every_token_in_order(gw: Harness) -> None:
    async with _client(gw) as client:
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=5,
            stream=True,
        )
        deltas, finishes = [], []
        async for chunk in stream:
            for choice in chunk.choices:
                deltas.append(choice.delta.content or "")
                finishes.append(choice.finish_reason)
    assert "".join(deltas) == "t0 t1 t2 t3 t4 "
    assert finishes[-1] == "length"
    assert gw.fake.completed == 1


async def test_chat_non_streaming_assembles_the_reply(gw: Harness) -> None:
    async with _client(gw) as client:
        reply = await client.chat.completions.create(
            model="fake-model", messages=[{"role": "user", "content": "hi"}], max_tokens=3
        )
    assert reply.choices[0].message.content == "t0 t1 t2 "
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    assert reply.usage.completion_tokens == 3


async def test_completions_streaming_and_not(gw: Harness) -> None:
    async with _client(gw) as client:
        reply = await client.completions.create(model="fake-model", prompt="x", max_tokens=4)
        stream = await client.completions.create(
            model="fake-model", prompt="x", max_tokens=4, stream=True
        )
        streamed = "".join([c.choices[0].text async for c in stream])
    assert reply.choices[0].text == "t0 t1 t2 t3 "
    assert streamed == "t0 t1 t2 t3 "


async def test_include_usage_is_honoured_and_usage_hidden_otherwise(gw: Harness) -> None:
    async with _client(gw) as client:
        plain = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
        )
        plain_usage = [c.usage async for c in plain]
        usage_stream = await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            stream=True,
            stream_options={"include_usage": True},
        )
        chunks = [c async for c in usage_stream]
    assert plain_usage == [None] * len(plain_usage)
    assert chunks[-1].choices == []
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 2


async def test_models_lists_the_configured_models(gw: Harness) -> None:
    async with _client(gw) as client:
        models = await client.models.list()
    assert [m.id for m in models.data] == ["fake-model"]


async def test_upstream_always_streams_with_usage_and_no_client_priority(gw: Harness) -> None:
    async with _client(gw) as client:
        await client.chat.completions.create(
            model="fake-model",
            messages=[{"role": "user", "content": "hi"}],
            max_tokens=2,
            extra_body={"priority": -100, "ignore_eos": True},
        )
    sent = gw.fake.bodies[-1]
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert "priority" not in sent
    assert sent["ignore_eos"] is True

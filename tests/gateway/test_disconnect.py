"""A client that leaves at any stage aborts its upstream request at once and frees its slot."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from .harness import Harness, start_gateway, until
from .sse_client import frames

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
_ABORT_WITHIN_S = 1.0  # "immediately" (~ms), with room for a heavily loaded CI machine


def _chat(stream: bool = True, **extra: Any) -> dict[str, Any]:
    return {
        "model": "fake-model",
        "messages": [{"role": "user", "content": "hi"}],
        "stream": stream,
        **extra,
    }


async def _cancel(task: asyncio.Task[Any]) -> None:
    task.cancel()
    await asyncio.wait([task])


async def test_disconnect_while_queued_leaves_the_queue_and_never_reaches_a_backend() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1}) as h:
        h.fake.default = {"step": True}
        first = asyncio.create_task(h.client.post(CHAT, json=_chat(stream=False, max_tokens=1)))
        await until(lambda: h.fake.running == 1)
        queued = asyncio.create_task(h.client.post(CHAT, json=_chat(max_tokens=1)))
        await until(lambda: h.gateway.runtime.queued == 1)
        await _cancel(queued)
        assert await until(lambda: h.gateway.runtime.queued == 0) < _ABORT_WITHIN_S
        h.fake.release()
        assert (await first).status_code == 200
        assert h.fake.seen == 1


async def test_disconnect_before_the_first_token_aborts_upstream(gw: Harness) -> None:
    task = asyncio.create_task(gw.client.post(CHAT, json=_chat(fake={"hang": True})))
    await until(lambda: gw.fake.running == 1)
    await _cancel(task)
    assert await until(lambda: gw.fake.aborted == 1) < _ABORT_WITHIN_S
    await until(lambda: gw.gateway.runtime.running == 0)


async def test_disconnect_mid_stream_aborts_upstream(gw: Harness) -> None:
    gw.fake.release(3)
    async with gw.client.stream("POST", CHAT, json=_chat(max_tokens=50, fake={"step": True})) as r:
        it = frames(r)
        for _ in range(4):  # role chunk and three tokens
            await anext(it)
        await until(lambda: gw.fake.tokens_sent == 3)
    # leaving the block closes the connection mid-stream
    assert await until(lambda: gw.fake.aborted == 1) < _ABORT_WITHIN_S
    assert gw.fake.tokens_sent == 3


async def test_disconnect_on_a_non_streaming_request_aborts_upstream(gw: Harness) -> None:
    gw.fake.release(2)
    task = asyncio.create_task(
        gw.client.post(CHAT, json=_chat(stream=False, max_tokens=50, fake={"step": True}))
    )
    await until(lambda: gw.fake.tokens_sent == 2)
    await _cancel(task)
    assert await until(lambda: gw.fake.aborted == 1) < _ABORT_WITHIN_S


async def test_disconnect_frees_the_slot_for_the_next_in_queue() -> None:
    async with start_gateway(gate={"max_concurrency_per_gpu": 1}) as h:
        first = asyncio.create_task(h.client.post(CHAT, json=_chat(fake={"hang": True})))
        await until(lambda: h.fake.running == 1)
        second = asyncio.create_task(h.client.post(CHAT, json=_chat(stream=False, max_tokens=2)))
        await until(lambda: h.gateway.runtime.queued == 1)
        await _cancel(first)
        r = await second
        assert r.status_code == 200
        assert r.json()["choices"][0]["message"]["content"] == "t0 t1 "
        await until(lambda: h.fake.aborted == 1, timeout_s=2)  # the relay's thread closes it
        assert h.fake.completed == 1

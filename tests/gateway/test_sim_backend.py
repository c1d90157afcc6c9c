"""Through the gateway to the simulated vLLM (`llmflow.sim.server`), as `llmflow serve` runs it."""

from __future__ import annotations

import asyncio

import openai
import pytest

from .harness import SIM_MODEL as MODEL
from .harness import start_sim_gateway, until
from .sse_client import frames

pytestmark = pytest.mark.anyio


async def test_openai_client_streams_and_completes_through_the_simulator() -> None:
    async with start_sim_gateway() as h:
        async with openai.AsyncOpenAI(base_url=h.url + "/v1", api_key="k", max_retries=0) as c:
            stream = await c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": "hello"}],
                max_tokens=12,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            chunks = [chunk async for chunk in stream]
            reply = await c.completions.create(
                model=MODEL, prompt="hello", max_tokens=6, extra_body={"ignore_eos": True}
            )
        assert chunks[-1].choices[0].finish_reason == "length"
        assert "".join(ch.choices[0].delta.content or "" for ch in chunks).strip()
        assert reply.usage is not None
        assert reply.usage.completion_tokens == 6
        # the native front counts a request as its task ends, just after the reply went out
        await until(lambda: h.gateway.metrics.outcomes["completed", "completed"] == 2)


async def test_a_disconnect_aborts_the_request_in_the_simulator() -> None:
    async with start_sim_gateway() as h:
        body = {
            "model": MODEL,
            "messages": [{"role": "user", "content": "hi"}],
            "stream": True,
            "max_tokens": 4000,
            "ignore_eos": True,
        }
        async with h.client.stream("POST", "/v1/chat/completions", json=body) as r:
            it = frames(r)
            await anext(it)
            await anext(it)

        async def sim_running() -> float:
            text = (await h.client.get(h.gateway.scraper.states["sim0"].url + "/metrics")).text
            line = next(x for x in text.splitlines() if x.startswith("vllm:num_requests_running"))
            return float(line.rsplit(" ", 1)[1])

        await until(lambda: h.gateway.runtime.running == 0)
        for _ in range(100):
            if await sim_running() == 0:
                break
            await asyncio.sleep(0.01)
        assert await sim_running() == 0

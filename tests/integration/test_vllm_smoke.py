"""Smoke tests against real vLLM (CPU) serving the tiny model, without the gateway.

They pin down the vLLM behaviour the gateway relies on: health and model listing, token-by-token
streaming through the real ``openai`` client, the Prometheus gauges and counters we read, and
that closing the client connection aborts the request in the engine.

All tests share one server (session fixture). Tests that read engine state or timing call
:func:`settle` first, so that requests left over from earlier tests cannot interfere.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING

import httpx
import openai
import pytest

if TYPE_CHECKING:
    from tests.integration.vllm_server import VllmServer

pytestmark = pytest.mark.integration

REQUIRED_METRICS = (
    "vllm:num_requests_running",
    "vllm:num_requests_waiting",
    "vllm:kv_cache_usage_perc",
    "vllm:num_preemptions_total",
    "vllm:generation_tokens_total",
)


def settle(server: VllmServer, timeout_s: float = 15.0) -> None:
    """Wait until the server has no request in flight and answers a 1-token request."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=timeout_s) as client:
        body = {"model": server.model, "prompt": "hi", "max_tokens": 1}
        client.post(f"{server.openai_base_url}/completions", json=body).raise_for_status()
        while time.monotonic() < deadline:
            metrics = server.metrics(client)
            if metrics["vllm:num_requests_running"] + metrics["vllm:num_requests_waiting"] == 0:
                return
            time.sleep(0.05)
    raise AssertionError(f"vLLM still busy after {timeout_s} s")


def test_health(vllm_server: VllmServer) -> None:
    response = httpx.get(f"{vllm_server.url}/health", timeout=5)
    assert response.status_code == 200


def test_models_lists_tiny(vllm_server: VllmServer) -> None:
    response = httpx.get(f"{vllm_server.openai_base_url}/models", timeout=5)
    response.raise_for_status()
    ids = [model["id"] for model in response.json()["data"]]
    assert ids == ["tiny"]


def test_streaming_completion_arrives_in_chunks(vllm_server: VllmServer) -> None:
    settle(vllm_server)
    max_tokens = 64
    with openai.OpenAI(base_url=vllm_server.openai_base_url, api_key="unused") as client:
        stream = client.completions.create(
            model=vllm_server.model,
            prompt="The gateway sends a request to the server",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        text_chunks: list[str] = []
        usage = None
        for chunk in stream:
            if chunk.choices and chunk.choices[0].text:
                text_chunks.append(chunk.choices[0].text)
            if chunk.usage is not None:
                usage = chunk.usage
    assert len(text_chunks) > 1
    assert usage is not None
    assert usage.completion_tokens == max_tokens


def test_streaming_chat_completion_uses_chat_template(vllm_server: VllmServer) -> None:
    settle(vllm_server)
    with openai.OpenAI(base_url=vllm_server.openai_base_url, api_key="unused") as client:
        stream = client.chat.completions.create(
            model=vllm_server.model,
            messages=[{"role": "user", "content": "Tell me a story about the queue."}],
            max_tokens=16,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        deltas = [c.choices[0].delta.content for c in stream if c.choices]
    assert sum(1 for d in deltas if d) > 1


def test_metrics_expose_engine_state(vllm_server: VllmServer) -> None:
    metrics = vllm_server.metrics()
    missing = [name for name in REQUIRED_METRICS if name not in metrics]
    assert not missing, f"missing metrics: {missing}"
    assert 0.0 <= metrics["vllm:kv_cache_usage_perc"] <= 1.0


def test_concurrent_streams_all_complete(vllm_server: VllmServer) -> None:
    """16 concurrent streams (the --max-num-seqs cap) all finish with every token."""
    streams, max_tokens = 16, 64

    async def one(client: openai.AsyncOpenAI, i: int) -> int:
        stream = await client.completions.create(
            model=vllm_server.model,
            prompt=f"Request number {i} asks for a long answer",
            max_tokens=max_tokens,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens = 0
        async for chunk in stream:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
        return tokens

    async def run_all() -> list[int]:
        async with openai.AsyncOpenAI(
            base_url=vllm_server.openai_base_url, api_key="unused"
        ) as client:
            return await asyncio.gather(*(one(client, i) for i in range(streams)))

    assert asyncio.run(run_all()) == [max_tokens] * streams


def test_client_disconnect_aborts_request(vllm_server: VllmServer) -> None:
    """Closing the connection mid-stream frees the engine slot within about a second.

    "Mid-stream": a first chunk has arrived and the engine's metrics show the request running
    with tokens generated but far from its ``max_tokens``.
    """
    settle(vllm_server)
    body = {
        "model": vllm_server.model,
        "prompt": "Write a very long answer",
        "max_tokens": 2000,  # ~7 s of decoding on 2 cores; max-model-len is 2048
        "stream": True,
        "ignore_eos": True,
    }
    with httpx.Client(timeout=10) as metrics_client:
        generated_before = vllm_server.metrics(metrics_client)["vllm:generation_tokens_total"]
        with (
            httpx.Client(timeout=30) as client,
            client.stream("POST", f"{vllm_server.openai_base_url}/completions", json=body) as resp,
        ):
            resp.raise_for_status()
            lines = resp.iter_lines()
            while not next(lines).startswith("data: "):
                pass  # at least one token has reached us: we are mid-stream
            deadline = time.monotonic() + 10
            while True:
                metrics = vllm_server.metrics(metrics_client)
                generated = metrics["vllm:generation_tokens_total"] - generated_before
                if metrics["vllm:num_requests_running"] == 1 and generated >= 20:
                    break
                assert generated < 1500, "request finished before the test could disconnect"
                assert time.monotonic() < deadline, f"request not decoding: {metrics}"
                time.sleep(0.05)
        closed = time.monotonic()  # leaving both context managers closed the connection

        deadline = closed + 1.0
        running = 1.0
        while time.monotonic() < deadline:
            running = vllm_server.metrics(metrics_client)["vllm:num_requests_running"]
            if running == 0:
                break
            time.sleep(0.02)
        elapsed = time.monotonic() - closed
        generated = vllm_server.metrics(metrics_client)["vllm:generation_tokens_total"]
    assert running == 0, f"request still running {elapsed:.2f} s after the client disconnected"
    assert generated - generated_before < 2000, "the request was not aborted"

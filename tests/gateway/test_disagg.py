"""Prefill/decode disaggregation through the gateway: two simulated vLLM prefill instances and
one decode instance that model vLLM's KV hand-off (`llmflow.sim.server_pd`), real HTTP.

What each backend was sent and how many requests it held at once is counted by a wrapper
around each simulated server (`Recorder`), not by the gateway; what the backends computed is
read from their own `/metrics`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import httpx
import openai
import pytest

from llmflow.config import load_settings
from llmflow.gateway.app import create_app
from llmflow.sim import server as sim_server
from llmflow.sim.server_pd import KvTransfer

from .harness import (
    SIM_MODEL,
    Harness,
    assert_idle,
    serve_asgi,
    serve_gateway,
    settings_for,
    until,
)
from .sse_client import frames

if TYPE_CHECKING:
    from collections.abc import AsyncIterator

pytestmark = pytest.mark.anyio


@dataclass
class Recorder:
    """ASGI wrapper: the JSON bodies sent to `/v1/*`, and the most in flight at once."""

    app: Any
    bodies: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    in_flight: int = 0
    peak: int = 0

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        while True:
            message = await receive()
            chunks.append(message.get("body", b""))
            if not message.get("more_body"):
                break
        self.bodies.append(json.loads(b"".join(chunks)))
        self.headers.append({k.decode(): v.decode() for k, v in scope["headers"]})
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        self.in_flight += 1
        self.peak = max(self.peak, self.in_flight)
        try:
            await self.app(scope, replay, send)
        finally:
            self.in_flight -= 1


def sim_app(link_gb_s: float, speed: float, max_model_len: int = 4096) -> Any:
    return sim_server.create_app(
        preset="h100:llama-3-8b", speed=speed, models=[SIM_MODEL], max_model_len=max_model_len,
        kv_transfer=KvTransfer(bandwidth_gb_s=link_gb_s, latency_ms=1.0),
    )


@dataclass
class Split:
    harness: Harness
    recorders: dict[str, Recorder]
    urls: dict[str, str]

    async def metric(self, backend: str, name: str) -> float:
        text = (await self.harness.client.get(self.urls[backend] + "/metrics")).text
        return sum(
            float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(name) and not line.startswith("#")
        )


@contextlib.asynccontextmanager
async def split_gateway(
    link_gb_s: float = 50.0, speed: float = 5.0, backend: dict[str, Any] | None = None,
    prefill_max_model_len: int = 4096, **sections: Any,
) -> AsyncIterator[Split]:
    """p0, p1 (prefill, one slot each) and d0 (decode, four slots) behind a gateway: H100s
    with Llama-3-8B at `speed` times real time."""
    recorders = {
        name: Recorder(sim_app(link_gb_s, speed, prefill_max_model_len if name[0] == "p" else 4096))
        for name in ("p0", "p1", "d0")
    }
    async with contextlib.AsyncExitStack() as stack:
        urls = {}
        for name, recorder in recorders.items():
            urls[name], _ = await stack.enter_async_context(serve_asgi(recorder))
        per_backend = {
            "p0": {"role": "prefill"}, "p1": {"role": "prefill"},
            "d0": {"role": "decode", "gpus": 4},
        }
        settings = settings_for(
            urls, backend, per_backend, **{"gate": {"max_concurrency_per_gpu": 1}, **sections}
        )
        app = create_app(settings)
        url = await stack.enter_async_context(serve_gateway(app))
        client = await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=60))
        harness = Harness(url, app.state.gateway, client, {}, app)
        yield Split(harness, recorders, urls)
        await assert_idle(harness)


async def test_a_split_request_prefills_on_one_instance_and_decodes_on_another() -> None:
    async with split_gateway(backend={"scheduling_policy": "priority"}) as s:
        prompt = "word " * 600  # ~600 tokens: 38 blocks to move
        async with openai.AsyncOpenAI(
            base_url=s.harness.url + "/v1", api_key="k", max_retries=0
        ) as c:
            stream = await c.chat.completions.create(
                model=SIM_MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=20,
                stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True, "min_tokens": 5},
            )
            chunks = [chunk async for chunk in stream]
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert len(text.split()) == 20
        # The decode hop streamed through Python: the front passes a split pool's requests to
        # the app (the native path does not serve them), which no longer lends the relay a
        # socket. The relay wrote nothing.
        metrics = s.harness.gateway.metrics
        assert metrics.relay is not None
        assert sum(metrics.relay.inter_chunk()[1]) == 0
        assert sum(metrics.inter_chunk.counts) > 0
        usage = chunks[-1].usage
        assert usage is not None
        assert usage.completion_tokens == 20
        p0, p1, d0 = (s.recorders[n] for n in ("p0", "p1", "d0"))
        # The prefill hop, as vLLM's proxy sends it: one token, not streamed, remote decode.
        assert (len(p0.bodies), len(p1.bodies), len(d0.bodies)) == (1, 0, 1)
        hop = p0.bodies[0]
        assert (hop["stream"], hop["max_tokens"]) == (False, 1)
        assert hop["kv_transfer_params"]["do_remote_decode"] is True
        assert not {"stream_options", "min_tokens"} & hop.keys()
        # Priorities: the hop's is its tier's alone (first come, first served on the prefill
        # instance); the decode's adds the request's KV footprint.
        assert hop["priority"] % 1000 == 0
        assert d0.bodies[0]["priority"] > hop["priority"]
        # The decode hop: the client's body plus what the prefill answered.
        decode = d0.bodies[0]
        assert (decode["stream"], decode["max_tokens"], decode["min_tokens"]) == (True, 20, 5)
        params = decode["kv_transfer_params"]
        assert params["do_remote_prefill"] is True
        assert params["remote_block_ids"]
        assert params["remote_port"] == int(s.urls["p0"].rsplit(":", 1)[1])
        assert p0.headers[0]["x-request-id"] == d0.headers[0]["x-request-id"]
        # The decode instance read the KV instead of computing the prompt: it prefilled only
        # the last prompt token (vLLM recomputes it), the prefill instance all of it; and the
        # prefill instance freed its blocks once they were read.
        computed = "llmflow_sim_prefill_computed_tokens_total"
        assert await s.metric("p0", computed) >= 600
        assert await s.metric("d0", computed) <= 16
        for _ in range(200):
            if await s.metric("p0", "vllm:kv_cache_usage_perc") == 0:
                break
            await asyncio.sleep(0.01)
        assert await s.metric("p0", "vllm:kv_cache_usage_perc") == 0


async def test_prefill_slots_and_decode_slots_each_bound_what_runs() -> None:
    async with split_gateway() as s:
        body = {
            "model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 300}],
            "max_tokens": 40, "ignore_eos": True,
        }
        replies = await asyncio.gather(
            *(s.harness.client.post("/v1/chat/completions", json=body) for _ in range(12))
        )
        assert [r.status_code for r in replies] == [200] * 12
        assert all(r.json()["usage"]["completion_tokens"] == 40 for r in replies)
        p0, p1, d0 = (s.recorders[n] for n in ("p0", "p1", "d0"))
        # One slot per prefill instance, four on the decode instance, as configured; both
        # prefill instances took a share, and every request decoded on d0 only.
        assert (p0.peak, p1.peak) == (1, 1)
        assert 3 <= d0.peak <= 4
        assert (len(p0.bodies) + len(p1.bodies), len(d0.bodies)) == (12, 12)
        assert min(len(p0.bodies), len(p1.bodies)) >= 3
        assert all(b["kv_transfer_params"]["do_remote_decode"] for b in p0.bodies + p1.bodies)
        assert all(b["kv_transfer_params"]["do_remote_prefill"] for b in d0.bodies)


async def test_a_client_leaving_during_the_prefill_hop_aborts_it() -> None:
    # A long prompt on a slow simulated GPU (a 3,000-token prefill takes ~0.15 s on an H100,
    # 3 s at 1/20 speed): the prefill hop is still running when the client goes; the prefill
    # instance must see its request end, and the decode never be sent.
    async with split_gateway(speed=0.05) as s:
        body = {
            "model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 2400}],
            "max_tokens": 10, "stream": True,
        }
        p0, p1 = s.recorders["p0"], s.recorders["p1"]
        task = asyncio.create_task(s.harness.client.post("/v1/chat/completions", json=body))
        await until(lambda: p0.in_flight + p1.in_flight == 1)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await until(lambda: p0.in_flight + p1.in_flight == 0)
        await until(lambda: s.harness.gateway.runtime.live == 0)
        assert s.recorders["d0"].bodies == []


async def test_a_first_token_streams_after_the_transfer() -> None:
    # A slow link (0.05 GB/s): ~3,000 tokens of Llama-3-8B KV (128 KiB each) take ~8 s to
    # move, simulated, 1.6 s of wall time at 5x; the client's first token waits for them.
    content = "word " * 2400
    prompt = sim_server.estimate_tokens(content) + 4  # the chat template's 4
    async with split_gateway(link_gb_s=0.05) as s:
        body = {
            "model": SIM_MODEL, "messages": [{"role": "user", "content": content}],
            "max_tokens": 5, "stream": True, "ignore_eos": True,
        }
        loop = asyncio.get_running_loop()
        begin = loop.time()
        async with s.harness.client.stream("POST", "/v1/chat/completions", json=body) as r:
            it = frames(r)
            await anext(it)
            first = loop.time() - begin
            rest = [f async for f in it]
        assert rest
        moved = prompt * 128 * 1024 / 0.05e9 / 5.0  # wall seconds on the link
        assert first >= 0.8 * moved, (first, moved)


async def test_built_in_backends_can_be_split() -> None:
    # Backends without a URL run the simulated vLLM in the gateway's process; with roles they
    # run its KV connector too, so a split config works on a bare machine.
    settings = load_settings(data={"backends": [
        {"name": "p", "models": [SIM_MODEL], "role": "prefill"},
        {"name": "d", "models": [SIM_MODEL], "role": "decode"},
    ]})
    app = create_app(settings)
    async with serve_gateway(app) as url, httpx.AsyncClient(
        base_url=url, timeout=30
    ) as client:
        body = {"model": SIM_MODEL, "prompt": "hello " * 50, "max_tokens": 8, "ignore_eos": True}
        reply = await client.post("/v1/completions", json=body)
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 8
        state = (await client.get("/api/state")).json()
        roles = {b["name"]: b["role"] for b in state["core"]["backends"]}
        assert roles == {"p": "prefill", "d": "decode"}
        d_url = app.state.gateway.scraper.states["d"].url
        text = (await client.get(d_url + "/metrics")).text
        pulled = [line for line in text.splitlines()
                  if line.startswith("llmflow_sim_prefill_computed_tokens_total")]
        assert pulled
        assert float(pulled[0].rsplit(" ", 1)[1]) <= 16  # the KV came from p


async def test_a_prefill_hop_refused_by_vllm_reaches_the_client_and_leaks_nothing() -> None:
    # The prefill instances run with a shorter context than the gateway was told: vLLM's 400
    # for the prompt comes back on the hop, passes through with its message, the decode is
    # never sent, and no slot stays held (`split_gateway` asserts the gateway idle at exit).
    async with split_gateway(prefill_max_model_len=1024) as s:
        body = {"model": SIM_MODEL, "messages": [{"role": "user", "content": "word " * 1200}],
                "max_tokens": 10, "stream": True}
        reply = await s.harness.client.post("/v1/chat/completions", json=body)
        assert reply.status_code == 400, reply.text
        assert "1024" in reply.json()["error"]["message"]
        assert s.recorders["d0"].bodies == []
        ok = await s.harness.client.post("/v1/chat/completions", json={
            **body, "messages": [{"role": "user", "content": "hello"}], "stream": False})
        assert ok.status_code == 200, ok.text
        assert all(b.healthy for b in s.harness.gateway.scraper.states.values())

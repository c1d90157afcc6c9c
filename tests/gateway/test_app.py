"""Lifecycle: graceful drain, the `llmflow serve` command, and the built-in simulated backend."""

from __future__ import annotations

import asyncio
import signal
import sys
from typing import TYPE_CHECKING

import httpx
import pytest
import yaml

from llmflow.config import load_settings
from llmflow.gateway.app import create_app
from llmflow.gateway.streaming import notice_for
from tests.processes import free_port

from .fake_vllm import FakeVllm
from .harness import serve_asgi, serve_gateway, start_gateway, until
from .sse_client import frames, text_of

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = pytest.mark.anyio

CHAT = "/v1/chat/completions"
BODY = {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "stream": True}


async def test_drain_refuses_new_requests_and_lets_live_ones_finish() -> None:
    async with start_gateway(server={"drain_timeout_ms": 5000}) as h:
        live = asyncio.create_task(
            h.client.post(CHAT, json={**BODY, "max_tokens": 20, "fake": {"itl": 0.01}})
        )
        await until(lambda: h.fake.running != 0)
        drain = asyncio.create_task(h.gateway.drain())
        await asyncio.sleep(0.01)
        refused = await h.client.post(CHAT, json=BODY)
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "draining"
        assert "retry-after" in refused.headers
        assert (await h.client.get("/readyz")).json()["draining"] is True
        chunks = [c async for c in frames(await live)]
        assert text_of(chunks) == "".join(f"t{i} " for i in range(20))
        assert "llmflow" not in chunks[-2]
        await drain
        assert h.fake.completed == 1


async def test_drain_timeout_cuts_what_is_left_with_a_notice() -> None:
    async with start_gateway(server={"drain_timeout_ms": 100}) as h:
        async with h.client.stream(
            "POST", CHAT, json={**BODY, "max_tokens": 1000, "fake": {"itl": 0.01}}
        ) as r:
            it = frames(r)
            await anext(it)
            drain = asyncio.create_task(h.gateway.drain())
            rest = [c async for c in it]
        await drain
        assert rest[-1] == "[DONE]"
        assert rest[-2]["llmflow"] == {"truncated": True, "reason": "shutdown"}
        assert text_of(rest).endswith(notice_for("shutdown"))
        await h.settle()
        assert h.fake.aborted == 1


async def test_llmflow_serve_runs_and_drains_on_sigterm(tmp_path: Path) -> None:
    fake = FakeVllm()
    async with serve_asgi(fake.app) as (backend_url, _):
        config = tmp_path / "gateway.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "backends": [{"name": "b0", "url": backend_url, "models": ["fake-model"]}],
                    "server": {"drain_timeout_ms": 5000},
                    "metrics": {"scrape_interval_ms": 100},
                }
            )
        )
        port = free_port()
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "llmflow.cli",
            "serve",
            "--config",
            str(config),
            "--port",
            str(port),
            stderr=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.DEVNULL,
        )
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=10) as client:
                for _ in range(500):
                    try:
                        if (await client.get("/readyz")).status_code == 200:
                            break
                    except httpx.TransportError:
                        pass
                    await asyncio.sleep(0.02)
                live = asyncio.create_task(
                    client.post(CHAT, json={**BODY, "max_tokens": 30, "fake": {"itl": 0.01}})
                )
                await until(lambda: fake.running != 0)
                proc.send_signal(signal.SIGTERM)
                chunks = [c async for c in frames(await live)]
            assert text_of(chunks) == "".join(f"t{i} " for i in range(30))
            assert await asyncio.wait_for(proc.wait(), 15) == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
        assert proc.stderr is not None
        log = (await proc.stderr.read()).decode()
        assert f"listening on http://127.0.0.1:{port}" in log
        assert f"backend b0 at {backend_url}: healthy" in log
        assert "draining: 1 live request(s)" in log


async def test_a_backend_without_url_runs_the_built_in_simulator() -> None:
    app = create_app(load_settings(data={"streaming": {"sse_flush_interval": 0}}))
    async with serve_gateway(app) as url, httpx.AsyncClient(base_url=url, timeout=30) as c:
        model = (await c.get("/v1/models")).json()["data"][0]["id"]
        r = await c.post(
            CHAT,
            json={
                "model": model,
                "max_tokens": 4,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": "hi"}],
            },
        )
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 4
        assert (await c.get("/readyz")).status_code == 200
        state = app.state.gateway.runtime
        assert (state.running, state.queued, state.kv_blocks_in_use) == (0, 0, 0)


async def test_drain_timeout_answers_queued_requests_with_503() -> None:
    async with start_gateway(
        gate={"max_concurrency_per_gpu": 1}, server={"drain_timeout_ms": 100}
    ) as h:
        running = asyncio.create_task(
            h.client.post(CHAT, json={**BODY, "max_tokens": 1000, "fake": {"itl": 0.01}})
        )
        await until(lambda: h.fake.running == 1)
        queued = asyncio.create_task(h.client.post(CHAT, json={**BODY, "max_tokens": 2}))
        await until(lambda: h.gateway.runtime.queued == 1)
        await h.gateway.drain()
        refused = await queued
        assert refused.status_code == 503
        assert refused.json()["error"]["code"] == "shutdown"
        chunks = [c async for c in frames(await running)]
        assert chunks[-2]["llmflow"]["reason"] == "shutdown"
        assert h.fake.seen == 1

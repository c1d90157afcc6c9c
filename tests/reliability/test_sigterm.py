"""SIGTERM under load, to a real `llmflow serve` process in front of a real `llmflow simserve`.

The gateway stops admitting at once (503 with Retry-After), lets the streams that can finish
within `server.drain_timeout_ms` finish untouched, cuts the rest with their partial text and
the notice, and exits 0. The streams take the native front's path, the one `llmflow serve`
takes for them (the Python path serves only what the front passes on).
"""

from __future__ import annotations

import asyncio
import os
import signal
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from tests.processes import GatewayProcess, SimServeProcess

from .replies import CHAT, stream_chat
from .zero import vllm_running

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = "sim"
SHORT, LONG = 3, 3  # streams that can finish within the grace period, and streams that cannot
GRACE_MS = 2000


def _config(url: str) -> dict[str, Any]:
    return {
        "gate": {"max_concurrency_per_gpu": 16},
        "streaming": {"sse_flush_interval": 0},
        "sla": {"ttft_ms": None},
        "metrics": {"scrape_interval_ms": 200},
        "server": {"drain_timeout_ms": GRACE_MS},
        "backends": [{"name": "b0", "url": url, "models": [MODEL], "max_model_len": 8192}],
    }


async def test_sigterm_refuses_newcomers_finishes_what_it_can_cuts_the_rest_and_exits_0(
    tmp_path: Path,
) -> None:
    with SimServeProcess(tmp_path, "--model-name", MODEL) as backend:
        gw = GatewayProcess(_config(backend.url), tmp_path).start()
        try:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                streams = [
                    asyncio.create_task(
                        stream_chat(client, model=MODEL, max_tokens=n, ignore_eos=True)
                    )
                    for n in [30] * SHORT + [5000] * LONG
                ]
                with anyio.fail_after(20):
                    while len((await client.get("/api/state")).json()["streams"]) < SHORT + LONG:
                        await asyncio.sleep(0.02)
                assert gw.process is not None
                os.kill(gw.process.pid, signal.SIGTERM)  # a real signal to a real process
                with anyio.fail_after(5):
                    while (r := await client.get("/readyz")).status_code != 503:
                        await asyncio.sleep(0.01)
                assert r.json()["draining"] is True
                refused = await client.post(
                    CHAT, json={"model": MODEL, "messages": [{"role": "user", "content": "x"}]}
                )
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "draining"
                assert int(refused.headers["retry-after"]) >= 1
                replies = await asyncio.wait_for(
                    asyncio.gather(*streams), timeout=GRACE_MS / 1e3 + 10
                )
            assert gw.process.wait(timeout=GRACE_MS / 1e3 + 15) == 0
        finally:
            gw.stop()
        for reply in replies[:SHORT]:  # finished within the grace period, untouched
            assert reply.status == 200
            assert reply.done, reply.events[-2:]
            assert reply.notice is None, reply.events[-2:]
            assert reply.error is None
            assert reply.text.count(" ") >= 30 - 1
        for reply in replies[SHORT:]:  # cut: the partial text, the notice, then [DONE]
            assert reply.status == 200
            assert reply.notice == {"truncated": True, "reason": "shutdown"}, reply.events[-2:]
            assert reply.text
            assert reply.done
        assert await vllm_running([backend.url])() == [0]  # the backend holds nothing

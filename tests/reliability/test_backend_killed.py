"""A backend killed mid-stream (SIGKILL to a real `llmflow simserve` behind a real
`llmflow serve`).

Every client whose stream ran on the killed backend gets the error as its stream's last word
(not a hang, not a `[DONE]` that reads as success); its slot is freed and the backend is
marked down at once, so new requests go to the live backend straight away (the scrape period
is set far longer than the test's window: only the failure itself can have told the gateway).
When a backend comes back on its port, traffic reaches it again. The streams take the native
front's path, the one `llmflow serve` takes for them (the Python path serves only what the
front passes on; its failures are checked in process, `test_broken_replies.py`).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import pytest

from tests.processes import GatewayProcess, SimServeProcess

from .replies import CHAT, Received, stream_chat
from .zero import assert_back_to_zero, vllm_running

if TYPE_CHECKING:
    from pathlib import Path

pytestmark = [pytest.mark.anyio, pytest.mark.slow]

MODEL = "sim"
STREAMS = 6  # long streams in flight when the backend dies
AFTER = 8  # requests sent right after the kill
BODY: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}


def _config(urls: list[str], scrape_ms: float = 30_000) -> dict[str, Any]:
    return {
        "gate": {"max_concurrency_per_gpu": 8},
        "streaming": {"sse_flush_interval": 0},
        "sla": {"ttft_ms": None},
        "metrics": {"scrape_interval_ms": scrape_ms, "stale_after_ms": 120_000},
        "server": {"drain_timeout_ms": 1000},
        "backends": [
            {"name": f"b{i}", "url": url, "models": [MODEL], "max_model_len": 8192}
            for i, url in enumerate(urls)
        ],
    }


async def _state(client: httpx.AsyncClient) -> dict[str, Any]:
    return (await client.get("/api/state")).json()  # type: ignore[no-any-return]


async def _until(predicate: Any, timeout_s: float = 20.0) -> None:
    with anyio.fail_after(timeout_s):
        while not await predicate():
            await asyncio.sleep(0.02)


async def _long_streams(client: httpx.AsyncClient, n: int) -> list[asyncio.Task[Received]]:
    """`n` long streams (spread over the backends); returns once all are streaming."""
    tasks = [
        asyncio.create_task(stream_chat(client, model=MODEL, max_tokens=3000, ignore_eos=True))
        for _ in range(n)
    ]

    async def all_streaming() -> bool:
        streams = (await _state(client))["streams"]
        return len(streams) == n and all(s["tokens"] > 0 for s in streams)

    await _until(all_streaming)
    return tasks


def _restart(tmp_path: Path, port: int) -> SimServeProcess:
    again = SimServeProcess(tmp_path, "--model-name", MODEL)
    again.port = port
    return again.start()


async def test_a_killed_backend_fails_its_streams_and_new_requests_go_to_the_live_one(
    tmp_path: Path,
) -> None:
    # Scrapes far apart: within the test only the failures can mark the backend down.
    with (
        SimServeProcess(tmp_path, "--model-name", MODEL) as live,
        SimServeProcess(tmp_path, "--model-name", MODEL) as doomed,
        GatewayProcess(_config([live.url, doomed.url]), tmp_path) as gw,
    ):
        async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
            tasks = await _long_streams(client, STREAMS)
            on = [s["backend"] for s in (await _state(client))["streams"]]
            on_doomed = on.count("b1")
            assert 0 < on_doomed < STREAMS, on  # both backends carry streams
            doomed.kill()
            done, running = await asyncio.wait(tasks, timeout=20)
            while len(done) < on_doomed and running:  # no hang: each ends within the bound
                more, running = await asyncio.wait(running, timeout=20)
                assert more, f"{on_doomed - len(done)} stream(s) hang after the kill"
                done |= more
            # Right away: new requests all go to the live backend.
            plain = {**BODY, "max_tokens": 4}
            after = await asyncio.gather(*(client.post(CHAT, json=plain) for _ in range(AFTER)))
            assert [r.status_code for r in after] == [200] * AFTER, [r.text for r in after]
            assert (await _state(client))["core"]["backends"][1]["healthy"] is False
            assert len(done) == on_doomed  # the live backend's streams go on
            for task in done:
                reply = task.result()
                assert reply.text  # the tokens from before the kill arrived
                reply.assert_failed_visibly()
            streams = (await _state(client))["streams"]
            assert [s["backend"] for s in streams] == ["b0"] * len(running)
            for task in running:  # their clients leave: the live backend aborts them
                task.cancel()
            await asyncio.wait(running)
            await assert_back_to_zero(gw.url, vllm_running([live.url, doomed.url]))
        assert gw.stop() == 0


async def test_traffic_resumes_when_the_killed_backend_comes_back(
    tmp_path: Path,
) -> None:
    doomed = SimServeProcess(tmp_path, "--model-name", MODEL).start()
    back: SimServeProcess | None = None
    try:
        with GatewayProcess(_config([doomed.url], scrape_ms=100), tmp_path) as gw:
            async with httpx.AsyncClient(base_url=gw.url, timeout=30) as client:
                tasks = await _long_streams(client, 3)
                doomed.kill()
                replies = await asyncio.wait_for(asyncio.gather(*tasks), timeout=20)
                for reply in replies:
                    reply.assert_failed_visibly()
                plain = {**BODY, "max_tokens": 4}
                refused = await client.post(CHAT, json=plain)  # nobody to serve it: fast 503
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["code"] == "no_healthy_backend"
                assert int(refused.headers["retry-after"]) >= 1
                await assert_back_to_zero(gw.url, vllm_running([doomed.url]))
                back = _restart(tmp_path, doomed.port)
                await _until(lambda: _healthy(client, 0))
                results = await asyncio.gather(*(client.post(CHAT, json=plain) for _ in range(4)))
                assert [r.status_code for r in results] == [200] * 4, [r.text for r in results]
                assert await _served_by(back.url) == 4  # the new process's own count
                await assert_back_to_zero(gw.url, vllm_running([back.url]))
            assert gw.stop() == 0
    finally:
        for process in (doomed, back):
            if process is not None:
                process.kill()


async def _healthy(client: httpx.AsyncClient, backend: int) -> bool:
    return bool((await _state(client))["core"]["backends"][backend]["healthy"])


async def _served_by(url: str) -> float:
    """Requests a (simulated) vLLM says it finished: its own `vllm:request_success_total`."""
    async with httpx.AsyncClient(timeout=5) as client:
        text = (await client.get(f"{url}/metrics")).text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("vllm:request_success_total")
    )

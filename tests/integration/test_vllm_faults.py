"""The fault suite's backend kill against real vLLM (CPU build), not the simulated one.

`tests/reliability/test_backend_killed.py` kills `llmflow simserve`; this kills a real vLLM
server's whole process group (API server and engine core) with SIGKILL while it streams, behind
a real `llmflow serve` that also has the session's live vLLM. What is checked comes from
outside: the bytes each client received, `/api/state` over HTTP, and each vLLM's own
`/metrics` (its running gauge, its success counter).

- Every stream on the killed server ends with a visible error, within a bound: not a hang,
  not a `[DONE]` that reads as success; the tokens from before the kill arrived.
- New requests go to the live server at once, and the dead one is marked down.
- Everything is back to zero: the gateway's slots, queue and KV ledger; the live vLLM's
  running count.
- A vLLM restarted on the same port is scraped healthy again and takes requests (its own
  success counter counts them).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.integration.gateway_server import gateway_config
from tests.integration.gwtools import GatewayPool, wait_vllm_idle
from tests.integration.vllm_server import VllmServer, parse_metrics
from tests.reliability.replies import CHAT, Received, stream_chat
from tests.reliability.zero import assert_back_to_zero, vllm_running

if TYPE_CHECKING:
    from collections.abc import Awaitable, Callable
    from pathlib import Path

    from tests.integration.conftest import ServerFactory

pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(600)]

STREAMS = 4  # long streams in flight when the server dies (the tiny model's 16 slots)
AFTER = 4  # requests sent right after the kill


def _body(**extra: Any) -> dict[str, Any]:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hello"}], **extra}


def _kill_group(server: VllmServer) -> None:
    """SIGKILL the server's process group: the API server and its engine-core child."""
    proc = server.process
    assert proc is not None
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(timeout=30)
    server.process = None


async def _until(check: Callable[[], Awaitable[bool]], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, f"not within {timeout_s:.0f} s: {what}"
        await asyncio.sleep(0.1)


async def _successes(client: httpx.AsyncClient, server: VllmServer) -> float:
    metrics = parse_metrics((await client.get(f"{server.url}/metrics")).text)
    return metrics.get("vllm:request_success_total", 0.0)


def test_a_killed_vllm_fails_its_streams_and_a_restarted_one_serves_again(
    vllm_server: VllmServer, vllm_server_factory: ServerFactory, tmp_path: Path
) -> None:
    live = vllm_server
    wait_vllm_idle(live)
    doomed = vllm_server_factory(())
    backend = gateway_config(live.url)["backends"][0]
    config = gateway_config(
        live.url,
        backends=[{**backend, "name": "b0"}, {**backend, "name": "b1", "url": doomed.url}],
        gate={"max_concurrency_per_gpu": 8},
        sla={"ttft_ms": None},
        server={"drain_timeout_ms": 1000},
    )
    with GatewayPool.running(tmp_path) as pool:
        gw = pool.start(config)

        async def scenario() -> None:
            async with httpx.AsyncClient(base_url=gw.url, timeout=60) as client:

                async def state() -> dict[str, Any]:
                    return (await client.get("/api/state")).json()  # type: ignore[no-any-return]

                tasks = [
                    asyncio.create_task(
                        stream_chat(client, **_body(max_tokens=1500, ignore_eos=True))
                    )
                    for _ in range(STREAMS)
                ]

                async def all_streaming() -> bool:
                    streams = (await state())["streams"]
                    return len(streams) == STREAMS and all(s["tokens"] > 0 for s in streams)

                await _until(all_streaming, 60, "every stream has tokens")
                on = [s["backend"] for s in (await state())["streams"]]
                on_doomed = on.count("b1")
                assert 0 < on_doomed < STREAMS, on  # both servers carry streams
                _kill_group(doomed)
                # The live server's streams may finish meanwhile (the tiny model is quick):
                # within the bound, exactly the killed server's streams end in an error.
                done, running = await asyncio.wait(tasks, timeout=30)
                replies: list[Received] = [task.result() for task in done]
                failed = [r for r in replies if r.error is not None or r.status != 200]
                assert len(failed) == on_doomed, f"{on_doomed - len(failed)} stream(s) hang"
                for reply in failed:
                    assert reply.text  # the tokens from before the kill arrived
                    reply.assert_failed_visibly()
                for reply in replies:
                    if reply not in failed:  # a live one that ended: a clean, whole reply
                        assert reply.events[-1] == "[DONE]", reply.events[-3:]
                assert (await state())["core"]["backends"][1]["healthy"] is False
                # Right away: new requests all go to the live server and succeed.
                plain = {**_body(max_tokens=4), "stream": False}
                after = await asyncio.gather(*(client.post(CHAT, json=plain) for _ in range(AFTER)))
                assert [r.status_code for r in after] == [200] * AFTER, [r.text for r in after]
                for task in running:  # their clients leave: the live server aborts them
                    task.cancel()
                await asyncio.gather(*running, return_exceptions=True)
                await assert_back_to_zero(gw.url, vllm_running([live.url, doomed.url]), 30)

                # The server comes back on its port: scraped healthy, it takes requests.
                again = VllmServer(
                    doomed.venv_python,
                    doomed.model_dir,
                    doomed.port,
                    log_path=tmp_path / "again.log",
                )
                await asyncio.to_thread(again.start)
                try:

                    async def healthy_again() -> bool:
                        return bool((await state())["core"]["backends"][1]["healthy"])

                    await _until(healthy_again, 30, "the restarted server is marked healthy")
                    before = await _successes(client, again)
                    replies = await asyncio.gather(
                        *(client.post(CHAT, json=plain) for _ in range(2 * AFTER))
                    )
                    assert [r.status_code for r in replies] == [200] * (2 * AFTER)
                    assert await _successes(client, again) > before  # it served some of them
                    await assert_back_to_zero(gw.url, vllm_running([live.url, again.url]), 30)
                finally:
                    with contextlib.suppress(Exception):
                        again.stop()

        asyncio.run(scenario())
        assert gw.stop() == 0
